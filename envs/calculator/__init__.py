"""`calculator`: arithmetic word problems solved with a `calc` tool (see env.py)."""
