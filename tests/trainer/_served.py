"""A store filled by `serve` once per test session (real SGLang tiny-moe, a two-turn env whose
rewards vary), shared by the loop and resume tests; tests copy it before consuming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_rl.app.serve import serve
from tests.rollout.conftest import serve_config
from tests.trainer.loop_envs import ENV_ID, register_loop_envs

EPISODES = 8  # 4 groups of 2
# A random model almost never ends a turn by itself; common letters end its turns early, so
# episodes finish (not truncated) and rewards vary with the answer's length.
STOP = ["e", "a"]


def served_config(db: Path, server_url: str, model: Path) -> Any:
    return serve_config(f"sqlite:///{db}", server_url, model, filter_zero_variance=False,
                        env=ENV_ID, stop=STOP)


@pytest.fixture
def served_db(tmp_path_factory: pytest.TempPathFactory, sglang_moe_server: Any,
              tiny_moe_model: Path) -> Path:
    """The served SQLite file (made on first use in this session; do not write to it)."""
    path = tmp_path_factory.getbasetemp() / "served-loop" / "store.db"
    if not path.is_file():
        register_loop_envs()
        path.parent.mkdir(exist_ok=True)
        cfg = served_config(path, sglang_moe_server.url, model=tiny_moe_model)
        stats = anyio.run(lambda: serve(cfg, max_episodes=EPISODES))
        assert stats.completed == EPISODES, stats
    return path
