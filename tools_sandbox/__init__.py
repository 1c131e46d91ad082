"""tools_sandbox package."""
