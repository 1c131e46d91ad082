"""`python-math`: math problems solved with a sandboxed Python interpreter (see env.py)."""
