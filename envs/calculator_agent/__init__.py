"""`calculator-agent`: the calculator's tasks, solved by an agent program written with the plain
`openai` client against the gateway (see agent.py and env.py)."""
