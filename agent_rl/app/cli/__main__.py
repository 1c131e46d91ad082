"""`python -m agent_rl.app.cli`: the same as the `agent-rl` command."""

from agent_rl.app.cli import main

main()
