"""`agent-rl train` as a process: SIGKILLed mid-run and restarted, it resumes from its checkpoint,
its held groups come back by lease, versions stay monotonic, no episode is trained twice and the
ledger balances. Bad input (model, empty store, unreachable router) is one line or a clear wait
message, never a silent hang."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomli_w

from agent_rl.config import load_config
from agent_rl.store import Store
from tests.trainer._served import served_db  # noqa: F401 (fixture)

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    env["COLUMNS"] = "200"
    return env


def _config(tmp: Path, db: Path, model: Path, **trainer: Any) -> Path:
    values: dict[str, Any] = dict(
        model=str(model), groups_per_step=1, micro_batch_size=4, checkpoint_every=1,
        export_every=1, checkpoint_dir=str(tmp / "ckpt"), export_dir=str(tmp / "exports"),
        tensorboard_dir=str(tmp / "tb"), claim_lease_s=3.0, data_poll_s=0.2,
    )
    values.update(trainer)
    path = tmp / "agent-rl.toml"
    path.write_text(tomli_w.dumps({"store": {"url": f"sqlite:///{db}"}, "trainer": values}))
    return path


def _versions(db: Path) -> list[int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM policy_versions ORDER BY version")]


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _train(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AGENT_RL, "--config", str(config), "train", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_sigkill_mid_run_then_resume(served_db: Path, tmp_path: Path, tiny_moe_model: Path) -> None:
    db = tmp_path / "store.db"
    db.write_bytes(served_db.read_bytes())
    config = _config(tmp_path, db, tiny_moe_model)
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([AGENT_RL, "--config", str(config), "train"], env=_env(),
                             stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    # One step committed and checkpointed; the next is under way.
    while max(_versions(db), default=0) < 1 or not list((tmp_path / "ckpt").glob("step_*[0-9]")):
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.2)
    helpers = _children(first.pid)  # the checkpoint writer's results-queue manager among them
    assert helpers, "a trainer that saved a checkpoint has its writer's helper process"
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    # Nothing the killed trainer started outlives it (each would hold hundreds of MB forever).
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in helpers):
        assert time.monotonic() < deadline, f"processes {helpers} outlived their SIGKILLed trainer"
        time.sleep(0.2)
    done = max(_versions(db))
    assert done < 4
    time.sleep(3.5)  # the killed trainer's lease runs out
    second = _train(config, "--max-steps", str(4 - done))
    print(second.stdout[-3000:])
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from checkpoint" in second.stdout
    assert _versions(db) == list(range(0, 5))  # 0: starting weights; monotonic, no gaps

    async def check() -> None:
        cfg = load_config(config)
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            episodes = await store.list_episodes(run_id=run)
            assert all(e.status == "trained" for e in episodes), [e.status for e in episodes]
            versions = [v for v in await store.policy_versions(run) if v["version"] > 0]
            # Every episode was counted by exactly one committed step.
            assert sum(v["metrics"]["episodes"] for v in versions) == len(episodes) == 8
            steps = [v["trainer_step"] for v in versions]
            assert steps == sorted(set(steps))
            assert (await store.ledger(run)).balances()

    asyncio.run(check())


def test_bad_model_dir_is_one_line(tmp_path: Path, tiny_moe_model: Path, tiny_dense_model: Path) -> None:
    config = _config(tmp_path, tmp_path / "s.db", tiny_moe_model)
    missing = _train(config, "--model", str(tmp_path / "nope"), timeout=60)
    assert missing.returncode == 1
    assert missing.stderr.strip().count("\n") == 0 and "no config.json" in missing.stderr
    config.write_text(config.read_text() + f'[engine]\nmodel = "{tiny_moe_model}"\n')
    mismatch = _train(config, "--model", str(tiny_dense_model), timeout=60)
    assert mismatch.returncode == 1 and "does not match engine.model" in mismatch.stderr
    assert mismatch.stderr.strip().count("\n") == 0


def test_empty_store_waits_with_a_message(tmp_path: Path, tiny_moe_model: Path) -> None:
    db = tmp_path / "empty.db"
    config = _config(tmp_path, db, tiny_moe_model)
    subprocess.run([AGENT_RL, "--config", str(config), "db", "upgrade"], env=_env(),
                   check=True, capture_output=True)
    log = tmp_path / "wait.log"
    with log.open("w") as out:
        proc = subprocess.Popen([AGENT_RL, "--config", str(config), "train"], env=_env(),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "waiting for data" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print(log.read_text()[-500:])
    assert "0/1 groups ready" in log.read_text()


def test_unreachable_router_is_one_line(tmp_path: Path, tiny_moe_model: Path) -> None:
    config = _config(tmp_path, tmp_path / "s.db", tiny_moe_model)
    subprocess.run([AGENT_RL, "--config", str(config), "db", "upgrade"], env=_env(),
                   check=True, capture_output=True)
    out = _train(config, "--router-url", "http://127.0.0.1:9", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    # Checked before the model is built: one line, nothing else.
    assert out.stderr.strip().startswith("error: router") and "unreachable" in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
