"""What `agent-rl launch` places, from `[cluster]` (agent_rl/cluster/plan.py): the groups, the
command each process runs, its Ray resources; a missing router token is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.cluster.plan import fill, make_plan
from agent_rl.config import Config
from agent_rl.kernel.errors import ConfigError


def _config(**cluster: object) -> Config:
    return Config.model_validate({"router": {"admin_token": "secret", "port": 30111},
                                  "cluster": {"accelerator": "accel", **cluster}})  # fmt: skip


def test_the_groups_run_the_cli_commands_with_their_resources(tmp_path: Path) -> None:
    cfg = _config(engines=2, serves=3, trainer_ranks=4,
                  engine_resources={"cpus": 2, "accelerators": 2},
                  serve_resources={"cpus": 1, "resources": {"cpu_node": 1}},
                  trainer_resources={"cpus": 8, "accelerators": 1}, trainer_strategy="SPREAD")
    config = tmp_path / "agent-rl.toml"
    plan = make_plan(cfg, config, until_version=7)
    assert [g.name for g in plan.groups] == [
        "router", "engine-0", "engine-1", "serve-0", "serve-1", "serve-2", "train"]
    head = ["--config", str(config.resolve())]
    engine, serve, train = plan.groups[1], plan.groups[3], plan.groups[-1]
    assert engine.args == [*head, "engine", "start", "--host", "{host}", "--port", "{port}"]
    assert engine.resources.ray_options() == {"num_cpus": 2, "num_gpus": 0.0,
                                              "resources": {"accel": 2}}  # fmt: skip
    assert fill(serve.args, {"router_url": "http://10.0.0.1:30111"}) == [
        *head, "serve", "--router-url", "http://10.0.0.1:30111", "--no-api"]
    assert serve.resources.bundle() == {"CPU": 1, "cpu_node": 1}
    assert train.args[-2:] == ["--until-version", "7"] and train.done_on_success
    assert (train.ranks, train.strategy) == (4, "SPREAD")
    assert train.process_names() == ["train-0", "train-1", "train-2", "train-3"]
    assert plan.router_port == 30111 and plan.admin_token == "secret"


def test_gpus_are_rays_own_resource() -> None:
    cfg = _config(accelerator="GPU", engine_resources={"cpus": 1, "accelerators": 8})
    assert make_plan(cfg, None).groups[1].resources.ray_options() == {
        "num_cpus": 1, "num_gpus": 8, "resources": {}}


def test_the_router_token_is_required() -> None:
    cfg = Config.model_validate({"router": {"admin_token": "  "}})
    with pytest.raises(ConfigError, match=r"set \[router\] admin_token"):
        make_plan(cfg, None)
