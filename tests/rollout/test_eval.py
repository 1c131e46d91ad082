"""`agent-rl eval` as a user runs it, against real SGLang: two evaluations of the same policy
version with the same seed sample the same tokens and score the same per-task rewards; another
seed samples other tokens. Each is a run of kind eval that names the run and version it scored,
has no policy versions of its own, and is listed among the run's evaluations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_rl.config import StoreConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.store import Store

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")


def _env(db: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    env.update(AGENT_RL_STORE__URL=f"sqlite:///{db}", AGENT_RL_RUN__NAME="trained",
               AGENT_RL_ROLLOUT__MAX_NEW_TOKENS="32", AGENT_RL_ROLLOUT__MAX_TURNS="2",
               AGENT_RL_ROLLOUT__ENV="calculator", AGENT_RL_TRAINER__TENSORBOARD_DIR=str(db.parent / "tb"))
    return env


def _eval(db: Path, url: str, model: Path, *args: str) -> dict[str, Any]:
    res = subprocess.run(
        [AGENT_RL, "eval", "--version", "0", "--weights", str(model), "--router-url", url,
         "--tasks", "4", "--samples", "2", "--json", *args],
        capture_output=True, text=True, env=_env(db), timeout=600, cwd=db.parent,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _eval_each(db: Path, url: str, requests: list[str]) -> list[dict[str, Any]]:
    """`agent-rl eval --from-stdin` (what `trainer.eval.every` runs): one process for all."""
    res = subprocess.run(
        [AGENT_RL, "eval", "--from-stdin", "--router-url", url, "--tasks", "4", "--samples", "2"],
        input="".join(r + "\n" for r in requests), capture_output=True, text=True, env=_env(db),
        timeout=600, cwd=db.parent,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # Standard output holds the replies and nothing else, one JSON line per request.
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.mark.slow  # two CLI processes, 24 episodes
def test_eval_reruns_are_reproducible(tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path) -> None:
    """The first two evaluations run in one `--from-stdin` process, with two malformed requests
    between them (each answered with an error; the next one still runs); the third is
    `agent-rl eval` of its own with another seed."""
    db = tmp_path / "store.db"
    request = json.dumps({"version": 0, "weights": str(tiny_moe_model)})
    first, bad, incomplete, again = _eval_each(
        db, sglang_moe_server.url, [request, "{not json", '{"version": 0}', request])
    other = _eval(db, sglang_moe_server.url, tiny_moe_model, "--seed", "99")
    assert first["ok"] and again["ok"] and not bad["ok"] and not incomplete["ok"]
    assert bad["version"] is None and "bad request '{not json'" in bad["error"]
    assert incomplete["error"].endswith("it has no 'weights'")
    assert first["run"] == "trained-eval-v0" and again["run"] == "trained-eval-v0-2"
    assert first["task_rewards"] == again["task_rewards"] and len(first["task_rewards"]) == 4
    assert first["episodes"] == again["episodes"] == 8 and first["failed"] == 0

    async def read() -> tuple[list[dict[str, Any]], dict[str, list[list[int]]], list[dict[str, Any]]]:
        async with await Store.open(StoreConfig(url=f"sqlite:///{db}")) as store:
            runs = {r["name"]: r for r in await store.list_runs()}
            tokens = {}
            for name in (first["run"], again["run"], other["run"]):
                episodes = await store.list_episodes(run_id=runs[name]["id"])
                streams = [await store.episode_tokens(e.id) for e in episodes]
                assert all(set(s.versions[s.loss_mask == 1].tolist()) == {0} for s in streams)
                tokens[name] = [s.token_ids.tolist() for s in streams]
            evaluations = await store.evaluations(runs["trained"]["id"])
            return list(runs.values()), tokens, evaluations

    runs, tokens, evaluations = anyio.run(read)
    by_name = {r["name"]: r for r in runs}
    trained = by_name["trained"]
    for name in (first["run"], again["run"], other["run"]):
        r = by_name[name]
        assert (r["kind"], r["evaluates_run_id"], r["evaluates_version"]) == ("eval", trained["id"], 0)
        assert r["latest_version"] is None  # no policy version of its own
    assert trained["kind"] == "train"
    assert tokens[first["run"]] == tokens[again["run"]]  # the same tokens, episode for episode
    assert tokens[other["run"]] != tokens[first["run"]]
    assert [e["name"] for e in evaluations] == [first["run"], again["run"], other["run"]]
    assert evaluations[0]["task_rewards"] == pytest.approx(first["task_rewards"])
    assert evaluations[0]["mean"] == pytest.approx(first["mean"])
    assert any((tmp_path / "tb").iterdir())  # eval/reward_mean at the version

    async def restore() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            await c.update_weights_from_disk(tiny_moe_model, weight_version="default")

    anyio.run(restore)
