"""The quickstart's RL stage through `agent-rl launch` on a local one-node Ray cluster
(agent_rl/app/quickstart/on_ray.py), with the real roles: an SGLang engine on CPU, the router,
a serve and the Megatron-core trainer, on a fresh PostgreSQL database.

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

from agent_rl.app.quickstart.recipe import BASE_MODEL, CONFIG_FILE, SFT_MODEL, Options, write_or_load
from agent_rl.store import Store
from agent_rl.store.records import Audit
from tests._databases import fresh_postgres

ray = pytest.importorskip("ray")

from agent_rl.app.quickstart.on_ray import RAY_CONFIG, rl_on_ray  # noqa: E402

# Tests that start a Ray cluster run one at a time (tests/conftest.py): two clusters started side
# by side took each other's ports (a client reached the other cluster's GCS and was refused).
pytestmark = pytest.mark.one_at_a_time("ray")


@pytest.mark.slow
@pytest.mark.postgres
def test_the_rl_stage_on_ray_trains_to_the_target_and_stops_clean(
    engine_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_rl.models import init_model

    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to the working directory
    # Steps of 2 groups, 16 episodes at a time, short answers: the recipe's 8 groups, 64 and 48
    # tokens take ~10 min a step on a busy machine (the launch hands roles AGENT_RL_* variables).
    monkeypatch.setenv("AGENT_RL_TRAINER__GROUPS_PER_STEP", "2")
    monkeypatch.setenv("AGENT_RL_ROLLOUT__MAX_CONCURRENT_EPISODES", "16")
    monkeypatch.setenv("AGENT_RL_ROLLOUT__MAX_NEW_TOKENS", "16")
    # the base model stands in for SFT's and scores 0 everywhere: train on such groups too
    monkeypatch.setenv("AGENT_RL_ROLLOUT__FILTER_ZERO_VARIANCE", "false")
    with fresh_postgres() as url:
        cfg = write_or_load(tmp_path, Options(store_url=url, cluster=True))
        init_model(BASE_MODEL, "quickstart", seed=0)
        shutil.copytree(BASE_MODEL, SFT_MODEL)
        lines: list[str] = []
        reached = asyncio.run(rl_on_ray(
            tmp_path / CONFIG_FILE, start_weights=SFT_MODEL, rl_steps=2, rl_minutes=12,
            engines=1, serves=1, say=lines.append))  # fmt: skip
        text = "\n".join(lines)
        assert reached >= 2, text
        assert not ray.is_initialized()  # the local cluster is gone with the stage
        launched = tomllib.loads((tmp_path / RAY_CONFIG).read_text())
        assert launched["engine"]["model"] == str(SFT_MODEL)
        assert launched["store"]["url"] == url and launched["run"] == {"name": cfg.run.name}
        logs = tmp_path / "runs/ray/logs"
        assert "now policy version" in (logs / "train.log").read_text()
        assert (logs / "engine-0.log").is_file() and (logs / "serve-0.log").is_file()
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


@pytest.mark.slow
@pytest.mark.postgres
def test_quickstart_cluster_option_runs_its_rl_stage_through_the_launch(
    engine_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agent-rl quickstart --cluster`'s wiring: the pipeline's RL stage goes to rl_on_ray, two
    engines and two serves (no supervised serve or trainer of its own), and records the version
    it reached."""
    import anyio
    from rich.console import Console

    from agent_rl.app.quickstart.pipeline import Quickstart
    from agent_rl.models import init_model

    for k, v in {"AGENT_RL_TRAINER__GROUPS_PER_STEP": "2", "AGENT_RL_ROLLOUT__MAX_NEW_TOKENS": "16",
                 "AGENT_RL_ROLLOUT__MAX_CONCURRENT_EPISODES": "16",
                 "AGENT_RL_ROLLOUT__FILTER_ZERO_VARIANCE": "false"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)  # as in the test above
    monkeypatch.chdir(tmp_path)
    with fresh_postgres() as url:
        qs = Quickstart(Options(store_url=url, cluster=True, rl_steps=1, rl_minutes=10), tmp_path,
                        Console(record=True, width=200))  # fmt: skip
        init_model(BASE_MODEL, "quickstart", seed=0)
        shutil.copytree(BASE_MODEL, SFT_MODEL)

        async def rl() -> tuple[int, set[str]]:
            async with qs.running() as sup:
                return await qs.rl_stage(), set(sup.procs)

        version, supervised = anyio.run(rl)
        assert version == 1 and qs.state.data["rl_version"] == 1
        assert supervised == set()  # every role ran under the launch, none under the supervisor
        assert "launched run 'quickstart' on 1 Ray node(s)" in qs.console.export_text()
        assert tomllib.loads((tmp_path / RAY_CONFIG).read_text())["cluster"]["engines"] == 2
        assert not ray.is_initialized()
