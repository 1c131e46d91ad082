"""`verifiers:<taskset or config>`: verifiers v1 environments, run out of process (env.py,
runner.py)."""
