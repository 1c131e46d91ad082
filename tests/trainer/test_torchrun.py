"""`agent-rl train` under torchrun, two ranks on CPU (gloo), against a real store filled by real
SGLang: data-parallel and tensor-parallel runs advance the policy version with every episode
trained once; a SIGKILL of one rank stops the job, and a restart resumes from its checkpoint;
a SIGTERM to one rank stops every rank at the same step, checkpointed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent_rl.config import load_config
from agent_rl.engine.launcher import free_port
from agent_rl.store import Store
from tests.trainer._served import served_db  # noqa: F401 (fixture)
from tests.trainer.test_resume import _config, _env, _versions
from trainer.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow


def _torchrun(config: Path, *args: str) -> list[str]:
    port = free_port()  # bound by torchrun's rendezvous later: outside the ephemeral range
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "agent_rl.app.cli", "--config", str(config), "train", *args]  # fmt: skip


def _check_store(config: Path, steps: int) -> None:
    async def check() -> None:
        cfg = load_config(config)
        async with await Store.open(cfg.store) as store:
            run = await store.run_id(cfg.run.name)
            episodes = await store.list_episodes(run_id=run)
            versions = [v for v in await store.policy_versions(run) if v["version"] > 0]
            assert [v["version"] for v in versions] == list(range(1, steps + 1))
            trained = [e for e in episodes if e.status == "trained"]
            # Every trained episode was counted by exactly one committed step.
            assert sum(v["metrics"]["episodes"] for v in versions) == len(trained) > 0
            assert (await store.ledger(run)).balances()

    asyncio.run(check())


def test_two_tensor_parallel_ranks_train_the_store(served_db: Path, tmp_path: Path,
                                                   tiny_moe_model: Path) -> None:  # fmt: skip
    """TP = 2 (and sequence parallelism, which MoE with TP needs) over two ranks."""
    db = tmp_path / "store.db"
    db.write_bytes(served_db.read_bytes())
    config = _config(tmp_path, db, tiny_moe_model, groups_per_step=2, parallel={"tp": 2})
    done = subprocess.run(_torchrun(config, "--max-steps", "2"), env=_env(), capture_output=True,
                          text=True, timeout=420)  # fmt: skip
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _versions(db) == [0, 1, 2]
    _check_store(config, 2)
    assert done.stdout.count("step 2") >= 1


def _rank_pid(parent: int, rank: str) -> int | None:
    """The descendant of `parent` that torchrun started as `rank`."""
    todo = [parent]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + rank.encode() in env:
                return child
            todo.append(child)
    return None


def _signal_rank(config: Path, log_path: Path, ready: Callable[[], bool], rank: str, sig: int,
                 wait_s: float) -> int:  # fmt: skip
    """Start the job, wait (up to 300 s) until `ready()`, send `sig` to `rank`, and return the
    job's exit status within `wait_s`. Whatever is left is killed, ranks too: torchrun starts
    each in a session of its own, out of reach of the job's process group."""
    job = subprocess.Popen(_torchrun(config), env=_env(), stdout=log_path.open("w"),
                           stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert job.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        ranks = [pid for pid in (_rank_pid(job.pid, r) for r in ("0", "1")) if pid is not None]
        target = _rank_pid(job.pid, rank)
        assert target is not None
        os.kill(target, sig)
        return job.wait(wait_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_stops_the_job_and_a_restart_resumes(served_db: Path, tmp_path: Path,
                                                          tiny_moe_model: Path) -> None:  # fmt: skip
    """DP = 2: both runs train data-parallel; the first loses rank 1 to SIGKILL after its first
    committed step, the second resumes from the checkpoint and trains the rest, each episode
    once, versions without gaps, and stops on a SIGTERM to rank 1 while rank 0 waits for data."""
    db = tmp_path / "store.db"
    db.write_bytes(served_db.read_bytes())
    config = _config(tmp_path, db, tiny_moe_model)
    # One rank lost: the job stops, it does not hang.
    assert _signal_rank(config, tmp_path / "first.log", lambda: max(_versions(db), default=0) >= 1,
                        "1", signal.SIGKILL, 120) != 0  # a step committed (and checkpointed)
    done = max(_versions(db))
    assert done < 4
    time.sleep(3.5)  # the killed job's lease runs out
    # The second run trains the rest, then waits for data that never comes; a SIGTERM to rank 1
    # alone (waiting inside the broadcast of that data) still stops the job, within a poll.
    second_log = tmp_path / "second.log"
    rc = _signal_rank(
        config, second_log,
        lambda: max(_versions(db)) >= 4 and "waiting for data" in second_log.read_text(),
        "1", signal.SIGTERM, 60,
    )  # fmt: skip
    out = second_log.read_text()
    print(out[-3000:])
    assert rc == 0, out[-3000:]
    assert "resumed from checkpoint" in out and f"trained {4 - done} steps" in out
    assert _versions(db) == list(range(0, 5))
    _check_store(config, 4)


def test_a_stop_asked_of_one_rank_stops_every_rank_at_the_same_step(
    served_db: Path, tmp_path: Path, tiny_moe_model: Path
) -> None:
    """DP = 2, SIGTERM to rank 1 only (as a scheduler stopping one task, or a signal reaching the
    ranks at different moments): every rank leaves at the same step, the job checkpoints and
    exits 0. Before the ranks agreed on stopping, rank 1 left alone and rank 0's next step
    failed on its collective (and a rank 0 stopped while waiting for data left rank 1 waiting in
    the broadcast of that data)."""
    db = tmp_path / "store.db"
    db.write_bytes(served_db.read_bytes())
    config = _config(tmp_path, db, tiny_moe_model)
    log_path = tmp_path / "job.log"
    rc = _signal_rank(config, log_path, lambda: max(_versions(db), default=0) >= 1, "1",
                      signal.SIGTERM, 120)  # fmt: skip
    log = log_path.read_text()
    assert rc == 0, log[-4000:]
    assert "stopping after the current step" in log
    steps = max(_versions(db))
    assert f"trained {steps} steps" in log
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest.name == f"step_{steps:08d}"
    _check_store(config, steps)
