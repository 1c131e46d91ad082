"""The quickstart's RL stage through `agent-rl launch` on a local one-node Ray cluster
(agent_rl/app/quickstart/on_ray.py), with the real roles: two SGLang engines on CPU, the router,
two serves and the Megatron-core trainer, on a fresh PostgreSQL database.

The quickstart's recipe and a random-init model stand in for its earlier stages (the SFT
output is a copy of the base model: RL starts from whatever HF model is there). Checked: the
launch trains from version 0 to the target, the engines were started on the weights RL resumes
from, the launch is stopped and Ray shut down afterwards, and the store's audit is clean.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import tomllib

import pytest

from agent_rl.app.quickstart.recipe import BASE_MODEL, SFT_MODEL, Options
from agent_rl.store import Store
from agent_rl.store.records import Audit
from tests._databases import fresh_postgres

ray = pytest.importorskip("ray")

from agent_rl.app.quickstart.on_ray import RAY_CONFIG  # noqa: E402

# Tests that start a Ray cluster run one at a time (tests/conftest.py): two clusters started side
# by side took each other's ports (a client reached the other cluster's GCS and was refused).
pytestmark = pytest.mark.one_at_a_time("fleet")


@pytest.mark.slow
@pytest.mark.postgres
def test_quickstart_cluster_option_trains_through_the_launch_and_stops_clean(
    engine_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agent-rl quickstart --cluster`'s RL stage: the pipeline hands it to rl_on_ray with two
    engines and two serves (no supervised serve or trainer of its own), trains from version 0 to
    the target on the weights RL resumes from, records the version reached, stops every role and
    shuts Ray down. One test for the wiring and the stage: each starts its own engines and
    cluster (CI time)."""
    import anyio
    from rich.console import Console

    from agent_rl.app.quickstart.pipeline import Quickstart
    from agent_rl.models import init_model

    # Steps of 2 groups, 16 episodes at a time, short answers: the recipe's 8 groups, 64 and 48
    # tokens take ~10 min a step on a busy machine (the launch hands roles AGENT_RL_* variables).
    # The base model stands in for SFT's and scores 0 everywhere: train on such groups too.
    for k, v in {"AGENT_RL_TRAINER__GROUPS_PER_STEP": "2", "AGENT_RL_ROLLOUT__MAX_NEW_TOKENS": "16",
                 "AGENT_RL_ROLLOUT__MAX_CONCURRENT_EPISODES": "16",
                 "AGENT_RL_ROLLOUT__FILTER_ZERO_VARIANCE": "false"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to the working directory
    with fresh_postgres() as url:
        qs = Quickstart(Options(store_url=url, cluster=True, rl_steps=2, rl_minutes=12), tmp_path,
                        Console(record=True, width=200))  # fmt: skip
        cfg = qs.cfg
        init_model(BASE_MODEL, "quickstart", seed=0)
        shutil.copytree(BASE_MODEL, SFT_MODEL)

        async def rl() -> tuple[int, set[str]]:
            async with qs.running() as sup:
                return await qs.rl_stage(), set(sup.procs)

        reached, supervised = anyio.run(rl)
        text = qs.console.export_text()
        assert reached >= 2 and qs.state.data["rl_version"] == reached, text
        assert supervised == set()  # every role ran under the launch, none under the supervisor
        assert not ray.is_initialized()  # the local cluster is gone with the stage
        launched = tomllib.loads((tmp_path / RAY_CONFIG).read_text())
        assert launched["cluster"]["engines"] == 2
        assert launched["engine"]["model"] == str(SFT_MODEL)
        assert launched["store"]["url"] == url and launched["run"] == {"name": cfg.run.name}
        logs = tmp_path / "runs/ray/logs"
        assert "now policy version" in (logs / "train.log").read_text()
        for role in ("engine-0", "engine-1", "serve-0", "serve-1"):
            assert (logs / f"{role}.log").is_file(), role
        # the stop stopped every role (a line each in the stage's output)
        assert "launched run 'quickstart' on 1 Ray node(s)" in text, text
        assert "stopping the launch" in text, text

        async def audit() -> tuple[Audit, list[int]]:
            async with await Store.open(cfg.store) as store:
                run_id = await store.ensure_run(cfg.run.name)
                versions = [v["version"] for v in await store.policy_versions(run_id)]
                return await store.audit(run_id), versions

        result, versions = asyncio.run(audit())
        assert versions[:3] == [0, 1, 2], versions  # the start, then one per step
        assert result.problems() == [], result  # none lost, none trained twice, all terminal
        for v in (1, 2):
            assert (tmp_path / cfg.trainer.export_dir / f"v{v:06d}" / "config.json").is_file()
    assert os.getcwd() == str(tmp_path)
