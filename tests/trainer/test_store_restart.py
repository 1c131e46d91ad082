"""`serve` and `train` carry on through a restart of their PostgreSQL, with the ledger intact.

Everything is real: a PostgreSQL server this test starts itself (tests/_own_postgres.py), the
session's SGLang server (tiny-moe) behind `serve`, and the Megatron trainer (TrainLoop) on
CPU, side by side on one run. While both are working (a group claimed or trained, serve still
admitting) the server is stopped (every connection terminated), kept down, and started
again, twice. Before the store's retry policy, the first store call that met the restart
raised sqlalchemy's OperationalError out of serve's task group and out of the trainer's loop.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from agent_rl.config import Config, StoreConfig, TrainerConfig
from agent_rl.app.serve import serve
from agent_rl.store import Store
from agent_rl.store.migrate import upgrade
from tests._own_postgres import OwnPostgres, own_postgres
from tests.rollout.conftest import serve_config
from tests.trainer._served import STOP
from tests.trainer.loop_envs import ENV_ID, register_loop_envs
from tests.trainer.test_loop import restore_engine  # noqa: F401 (fixture)
from trainer.learner import learner
from trainer.loop import TrainLoop

pytestmark = pytest.mark.slow

EPISODES = 24  # 12 groups of 2; the trainer takes 3 steps of 2 groups
STEPS = 3


def config(url: str, tmp: Path, server_url: str, model: Path) -> Config:
    cfg = serve_config(url, server_url, model, filter_zero_variance=False, env=ENV_ID, stop=STOP)
    trainer = TrainerConfig(
        groups_per_step=2, micro_batch_size=4, optim={"lr": 3e-5},
        weight_sync={"router_url": server_url},
        checkpoint_dir=tmp / "ckpt", export_dir=tmp / "exports", tensorboard_dir=tmp / "tb",
        data_poll_s=0.2, max_staleness=4,
    )
    return cfg.model_copy(update={"trainer": trainer})


def groups_in_training(pg: OwnPostgres) -> int:
    """Groups claimed or trained so far (0 while the server is down)."""
    try:
        with psycopg.connect(pg.url, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT count(*) FROM groups WHERE status IN ('claimed', 'trained')").fetchone()
            return int(row[0]) if row else 0
    except psycopg.Error:
        return 0


def test_serve_and_train_ride_through_a_postgres_restart(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, restore_engine: None,  # noqa: F811
) -> None:
    register_loop_envs()
    with own_postgres() as pg:
        cfg = config(pg.url, tmp_path, sglang_moe_server.url, tiny_moe_model)
        anyio.run(upgrade, StoreConfig(url=pg.url))
        outcome: dict[str, Any] = {}

        def run_serve() -> None:
            try:
                outcome["serve"] = anyio.run(lambda: serve(cfg, max_episodes=EPISODES))
            except BaseException as e:  # reported by the assertions below
                outcome["serve_error"] = e

        serving = threading.Thread(target=run_serve)
        restarts: list[tuple[int, bool]] = []  # (groups in training, serve still running)

        def restart_twice() -> None:
            for needed in (1, 3):
                deadline = time.monotonic() + 600
                while groups_in_training(pg) < needed and time.monotonic() < deadline:
                    time.sleep(0.2)
                restarts.append((groups_in_training(pg), serving.is_alive()))
                pg.restart("fast", down_s=3.0)

        restarter = threading.Thread(target=restart_twice)
        serving.start()
        restarter.start()
        lines: list[str] = []
        try:
            with learner(tiny_moe_model, cfg.trainer) as e:
                stats = TrainLoop(cfg, e, log=lines.append).run(max_steps=STEPS)
        finally:
            serving.join(timeout=900)
            restarter.join(timeout=900)
        print("\n".join(lines))

        assert "serve_error" not in outcome, repr(outcome.get("serve_error"))
        assert len(restarts) == 2 and all(alive for _, alive in restarts), restarts
        assert stats.steps == STEPS and stats.version == STEPS
        assert outcome["serve"].ledger.admitted == EPISODES

        async def audit() -> Any:
            async with await Store.open(StoreConfig(url=pg.url)) as store:
                return await store.audit(await store.run_id(cfg.run.name))

        result = anyio.run(audit)
        assert result.problems() == [], result.problems()
        assert result.ledger.trained == result.trained_by_steps > 0
        assert result.ledger.admitted == EPISODES
        with psycopg.connect(pg.url) as conn:
            failed = conn.execute(
                "SELECT id, error_type, error_cause FROM episodes WHERE status = 'failed'"
            ).fetchall()
        assert failed == [] and result.ledger.failed == 0, failed
