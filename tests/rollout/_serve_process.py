"""`serve` in a process of its own (the fault envs registered), for tests that SIGKILL it.

    python -m tests.rollout._serve_process CONFIG_JSON MAX_EPISODES
"""

from __future__ import annotations

import sys

import anyio

from agent_rl.config import Config
from agent_rl.app.serve import serve
from tests.rollout.fault_envs import register_fault_envs

if __name__ == "__main__":
    register_fault_envs()
    cfg = Config.model_validate_json(sys.argv[1])
    anyio.run(lambda: serve(cfg, max_episodes=int(sys.argv[2])))
