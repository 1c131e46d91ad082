"""Rollout: the scheduler that admits groups of episodes and the runner that plays each one."""
