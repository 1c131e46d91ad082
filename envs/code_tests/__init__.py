"""`code-tests`: write a function; hidden unit tests run in the sandbox (see env.py)."""
