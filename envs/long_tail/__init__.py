"""`long-tail`: heavy-tailed episodes for stress-testing the asynchronous pipeline (see env.py)."""
