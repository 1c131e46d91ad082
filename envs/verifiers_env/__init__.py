"""`verifiers:<taskset or config>`: verifiers v1 environments, run out of process in env
servers of their own or a process per episode (env.py, pool.py, runner.py)."""
