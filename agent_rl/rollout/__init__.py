"""Rollout: the episode runner, the scheduler and the pieces they share (tool-call parsing)."""
