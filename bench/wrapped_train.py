"""The ecosystems verifiers wraps, served and trained (issue 46 item 3): TextArena's Hangman
(its word list read offline from envs/verifiers_env/nltk_data) and an OpenEnv environment
served locally by OpenEnv's own server, each through verifiers 0.4.0's taskset in a verifiers
env server, with agent-rl's `serve` and `train` running together on one CPU engine.

For each env, in a working directory of its own: a random-init `quickstart` model (1.1M
parameters); one SGLang engine behind `agent-rl router`; `agent-rl serve --router-url R` (the
env in a verifiers env server, the model's seat played by `vf_chat`) and `agent-rl train
--router-url R --until-version V` (GRPO, a weight sync to the engine after every step),
supervised as the quickstart supervises them (agent_rl/app/quickstart/processes.py). When the
trainer has published version V, serve is stopped (running episodes finish first) and the
store is read: the policy versions and how many episodes each step trained on, the ledger,
the audit's problems (none: every episode in one recorded state, none trained twice).

- `openenv`: `tests/ecosystems/verifiers_modules/openenv_repeat.py letters` (OpenEnv's HTTP
  server on loopback; no container, no registry): two rounds of "Say the word X", each reply
  earning the share of the word's letters it contains, so a random policy's rewards vary and
  groups carry GRPO signal (`filter_zero_variance` on, as by default).
- `textarena`: `Hangman-v0`, at most 3 moves. A random policy never makes a valid move (a
  bracketed letter), so every reward is 0: `filter_zero_variance = false` hands its groups to
  the trainer anyway (zero advantages: the steps consume the episodes, the policy does not
  move). Learning Hangman needs a policy that can already play.

    python bench/wrapped_train.py [--env openenv textarena] [--versions 3] [--workdir DIR]

Needs the verifiers environment (`AGENT_RL_VERIFIERS_PYTHON`, else `.venv-verifiers`) with
`verifiers[ta]==0.4.0` and `openenv==0.4.1` (docs/ecosystems.md). Last line: RESULT {"ENV":
{"versions", "trained_per_step", "reward_mean_per_step", "ledger", "audit_problems",
"episodes", "failed_causes", "wall_s", "load"}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tomli_w  # noqa: E402

from agent_rl.app.quickstart.processes import Supervisor, agent_rl_command  # noqa: E402
from agent_rl.engine.launcher import free_port  # noqa: E402
from agent_rl.store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPENENV_SERVER = ROOT / "tests" / "ecosystems" / "verifiers_modules" / "openenv_repeat.py"
START_TIMEOUT_S = 900.0
"""An engine's start (and the OpenEnv server's) on a busy 2-core machine."""


def verifiers_python() -> str:
    python = os.environ.get("AGENT_RL_VERIFIERS_PYTHON") or str(ROOT / ".venv-verifiers/bin/python")
    if not Path(python).is_file():
        sys.exit(f"no verifiers environment at {python}: see docs/ecosystems.md")
    return python


def env_settings(name: str, python: str, openenv_url: str | None) -> dict[str, Any]:
    """The rollout settings of `name`: its env id and kwargs, and what differs per env."""
    seat = {"harness": {"id": "vf_chat"}}
    if name == "textarena":
        config = {"taskset": {"game": "Hangman-v0"}, "player": {**seat, "max_turns": 3}}
        return {"env": "verifiers:textarena", "max_new_tokens": 16, "filter_zero_variance": False,
                "env_kwargs": {"python": python, "config": config, "max_tasks": 64}}  # fmt: skip
    config = {"taskset": {"base_url": openenv_url, "resets": [{"seed": i} for i in range(32)]},
              "player": {**seat, "max_turns": 2}}  # fmt: skip
    return {"env": "verifiers:openenv", "max_new_tokens": 8,
            "env_kwargs": {"python": python, "config": config}}  # fmt: skip


def recipe(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """agent-rl.toml of the run: the quickstart's RL settings, small groups and steps."""
    rollout = {"seed": 0, "group_size": 4, "max_concurrent_episodes": 16, "max_turns": 4,
               "max_tokens": 2048, "temperature": 1.0, "heartbeat_s": 2.0,
               "stale_after_s": 15.0, **settings}  # fmt: skip
    return {
        "run": {"name": f"wrapped-{name}"},
        "store": {"url": "sqlite:///agent_rl.db"},
        "engine": {"model": "runs/model", "log_dir": "runs/logs"},
        "router": {"port": free_port(), "admin_token": secrets.token_urlsafe(24)},
        "rollout": rollout,
        "trainer": {
            "model": "runs/model", "seed": 0, "groups_per_step": 2, "micro_batch_size": 8,
            "max_staleness": 2, "export_every": 1, "checkpoint_every": 100,
            "claim_lease_s": 30.0, "data_poll_s": 0.5, "checkpoint_dir": "runs/checkpoints",
            "export_dir": "runs/exports", "tensorboard_dir": "runs/tensorboard",
            "optim": {"lr": 1e-4},
        },  # fmt: skip
    }


def load() -> float:
    return os.getloadavg()[0]


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} load {load():5.1f}  {line}", file=sys.stderr, flush=True)


def wait_http(url: str, timeout_s: float, alive: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if alive is not None and not alive():
            raise RuntimeError(f"the process behind {url} exited")
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


async def run_env(name: str, workdir: Path, versions: int, python: str) -> dict[str, Any]:
    """Serve and train `name` in `workdir` up to policy `versions`; what the store says."""
    from agent_rl.models import init_model
    from agent_rl.store.migrate import upgrade

    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    started, loads = time.monotonic(), [load()]
    init_model(Path("runs/model"), "quickstart", seed=0)
    openenv = None
    if name == "openenv":
        port = free_port()
        Path("runs/logs").mkdir(parents=True, exist_ok=True)
        log = open("runs/logs/openenv.log", "wb")  # noqa: SIM115 - the child's
        openenv = subprocess.Popen([python, str(OPENENV_SERVER), str(port), "letters"],
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_http(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, lambda: openenv.poll() is None)
        settings = env_settings(name, python, f"http://127.0.0.1:{port}")
    else:
        settings = env_settings(name, python, None)
    cfg = recipe(name, settings)
    Path("agent-rl.toml").write_text(tomli_w.dumps(cfg))
    await upgrade(_store_cfg())  # before serve and train both open it
    sup = Supervisor(workdir, on_event=say)
    watcher = asyncio.ensure_future(sup.watch())
    try:
        return await _serve_and_train(name, sup, cfg, versions, started, loads)
    finally:
        await sup.stop_all(["train", "serve", "router", "engine"])
        watcher.cancel()
        if openenv is not None:
            openenv.send_signal(signal.SIGTERM)
            openenv.wait(timeout=30)


async def _serve_and_train(name: str, sup: Supervisor, cfg: dict[str, Any], versions: int,
                           started: float, loads: list[float]) -> dict[str, Any]:  # fmt: skip
    engine_port = free_port()
    engine = sup.add("engine", agent_rl_command("engine", "start", "--model", "runs/model",
                                                "--port", str(engine_port)),
                     log_path=Path("runs/logs/engine.log"))  # fmt: skip
    router_url = f"http://127.0.0.1:{cfg['router']['port']}"
    sup.add("router", agent_rl_command("router", "--worker", f"http://127.0.0.1:{engine_port}"),
            log_path=Path("runs/logs/router.log"))  # fmt: skip
    await asyncio.to_thread(wait_http, f"http://127.0.0.1:{engine_port}/health", START_TIMEOUT_S,
                            lambda: engine.running)  # fmt: skip
    await asyncio.to_thread(wait_http, f"{router_url}/model_info", 120)
    say(f"{name}: engine and router up; serve and train to version {versions}")
    sup.add("serve", agent_rl_command("serve", "--router-url", router_url, "--no-api"),
            log_path=Path("runs/logs/serve.log"))  # fmt: skip
    train = sup.add("train", agent_rl_command("train", "--router-url", router_url,
                                              "--until-version", str(versions)),
                    log_path=Path("runs/logs/train.log"), restart=False)  # fmt: skip
    async with await Store.open(_store_cfg()) as store:
        run_id = await store.ensure_run(cfg["run"]["name"])
        deadline = time.monotonic() + 1800
        while train.running and time.monotonic() < deadline:
            await asyncio.sleep(10)
            loads.append(load())
            ledger = (await store.ledger(run_id)).as_dict()
            say(f"{name}: version {await store.latest_version(run_id)}/{versions}, ledger {ledger}")
        say(f"{name}: the trainer exited ({train.proc.poll() if train.proc else None}); stopping serve")
        await sup.stop("serve", grace_s=120)
        await store.resolve_interrupted(stale_after_s=0.0, run_id=run_id)
        return await _result(store, run_id, train.proc.returncode if train.proc else None,
                             started, loads)  # fmt: skip


def _store_cfg() -> Any:
    from agent_rl.config import load_config

    return load_config(Path("agent-rl.toml")).store


async def _result(store: Store, run_id: int, train_status: int | None, started: float,
                  loads: list[float]) -> dict[str, Any]:  # fmt: skip
    steps = [v for v in await store.policy_versions(run_id) if v["version"] > 0]
    episodes, after = [], None
    while batch := await store.list_episodes(run_id=run_id, after_id=after, limit=500):
        episodes += batch
        after = batch[-1].id
    trained: dict[int, int] = {}
    for e in episodes:
        if e.trained_step is not None:
            trained[e.trained_step] = trained.get(e.trained_step, 0) + 1
    rewards = [e.reward for e in episodes if e.reward is not None]
    return {
        "train_exit_status": train_status,
        "versions": [v["version"] for v in steps],
        "trained_per_step": [trained.get(v["version"], 0) for v in steps],
        "reward_mean_per_step": [(v["metrics"] or {}).get("reward_mean") for v in steps],
        "ledger": (await store.ledger(run_id)).as_dict(),
        "audit_problems": (await store.audit(run_id)).problems(),
        "episodes": len(episodes),
        "turns_mean": round(sum(e.num_turns for e in episodes) / max(len(episodes), 1), 2),
        "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "rewards_distinct": len(set(rewards)),
        "failed_causes": sorted({(e.error_cause or "")[:200] for e in episodes if e.status == "failed"})[:5],
        "wall_s": round(time.monotonic() - started, 1),
        "load": [round(min(loads), 1), round(max(loads), 1)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", nargs="+", choices=["openenv", "textarena"], default=["openenv", "textarena"])
    ap.add_argument("--versions", type=int, default=3, help="policy versions to train to")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    args = ap.parse_args()
    python = verifiers_python()
    base = (args.workdir or Path(tempfile.mkdtemp(prefix="wrapped-train-"))).resolve()
    out = {}
    for name in args.env:
        say(f"{name}: in {base / name}")
        out[name] = asyncio.run(run_env(name, base / name, args.versions, python))
        say(f"{name}: {json.dumps(out[name])}")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
