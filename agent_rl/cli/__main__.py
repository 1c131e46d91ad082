"""`python -m agent_rl.cli`: the same as the `agent-rl` command."""

from agent_rl.cli import main

main()
