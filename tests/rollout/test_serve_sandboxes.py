"""`serve` draws every episode's sandbox from the pool, so each `[sandbox]` pool key does what
docs/sandbox.md says: `max_sandboxes` caps live sandboxes across concurrent episodes,
`warm_pool` starts them before episodes ask and replaces each one taken, `create_concurrency`
caps creations at once, `create_jitter_s` spreads them. A sandbox that cannot be had still ends
its episode in exactly one recorded state, and serve leaves no sandbox behind.

Real `serve`, scheduler and episode runner, a SQLite store, real bubblewrap sandboxes (root
only, as in tests/tools_sandbox); the engine is the stand-in (`agent_rl.testing.stand_in_engine`,
every turn answers "413" at once), so what takes time is the sandboxes and the env's hold.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from agent_rl import Env, StepResult
from agent_rl.app.serve import ServeSummary, serve
from agent_rl.config import (Config, EngineConfig, RolloutConfig, SandboxConfig, SandboxLimits,
                             StoreConfig)
from agent_rl.rollout.render import ChatRenderer
from agent_rl.sdk.messages import AssistantTurn, Message, user
from agent_rl.sdk.registry import register
from agent_rl.sdk.sandbox import Mount, SandboxSpec
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.store import Store
from agent_rl.testing.stand_in_engine import StandInEngine
from tests.tools_sandbox.conftest import CGROUP_PARENT

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(os.geteuid() != 0, reason="bubblewrap sandboxes need root")]

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=128, pids=48, disk_mb=32, tmp_mb=16,
                       output_bytes=65536)


class HoldingEnv(Env):
    """Holds its sandbox for `hold_s` and runs one call in it; records, across its episodes,
    how many held a sandbox at once and how long each waited for it (make to reset)."""

    uses_sandbox = True
    sandbox_spec = SandboxSpec(limits=LIMITS)
    hold_s: ClassVar[float] = 0.0
    holding: ClassVar[int] = 0
    peak: ClassVar[int] = 0
    waits: ClassVar[list[float]] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.made = time.monotonic()
        self.held = False

    @classmethod
    def clear(cls, hold_s: float) -> None:
        cls.hold_s, cls.holding, cls.peak, cls.waits = hold_s, 0, 0, []

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id=f"t{i}", data={"q": f"question {i}"}) for i in range(8)])

    def initial_messages(self, task: Task) -> list[Message]:
        cls = type(self)
        cls.waits.append(time.monotonic() - self.made)
        cls.holding += 1
        cls.peak = max(cls.peak, cls.holding)
        self.held = True
        return [user(task["q"])]

    async def step(self, turn: AssistantTurn) -> StepResult:
        await anyio.sleep(type(self).hold_s)
        assert self.sandbox is not None
        out = await self.sandbox.run_python("print(6 * 7)")
        return StepResult(reward=float(out.stdout == "42\n"), terminated=True)

    async def close(self) -> None:
        if self.held:  # the runner closes the env before it hands the sandbox back
            type(self).holding -= 1
            self.held = False
        await super().close()

    async def score(self, answer: str) -> float:
        return 0.0


class UnstartableEnv(HoldingEnv):
    """Its sandbox mounts a host path that does not exist: bubblewrap cannot start it."""

    sandbox_spec = SandboxSpec(limits=LIMITS, mounts=(Mount(source="/nonexistent/agent-rl-test",
                                                            target="/data"),))


@pytest.fixture
def state_dir() -> Iterator[Path]:
    state = Path(tempfile.mkdtemp(prefix="agent-rl-serve-sandboxes-"))
    state.chmod(0o711)  # sandbox uids must traverse it to reach their work dirs
    yield state
    shutil.rmtree(state, ignore_errors=True)


def leftovers(state: Path) -> list[str]:
    """Sandbox dirs and mounts still under `state` (none once every sandbox is closed)."""
    root = state / "bwrap"
    left = [f"dir {p.name}" for p in root.iterdir() if p.is_dir()] if root.exists() else []
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {m}" for m in (line.split()[4] for line in f) if m.startswith(f"{state}/")]
    return left


async def run(tmp_path: Path, model: Path, state: Path, env_id: str, episodes: int, *,
              concurrent: int, **sandbox: Any) -> ServeSummary:  # fmt: skip
    """Serve `episodes` episodes of `env_id`, `concurrent` at once, with `sandbox` keys."""
    renderer = ChatRenderer(model)
    async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
        cfg = config(tmp_path, model, engine.url, env_id, concurrent, state, **sandbox)
        with anyio.fail_after(120):
            return await serve(cfg, max_episodes=episodes)


def config(tmp_path: Path, model: Path, url: str, env_id: str, concurrent: int, state: Path,
           **sandbox: Any) -> Config:  # fmt: skip
    return Config(
        store=StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}"),
        engine=EngineConfig(model=model),
        rollout=RolloutConfig(env=env_id, router_url=url, group_size=1, max_turns=1,
                              max_concurrent_episodes=concurrent, max_queued_groups=0,
                              filter_zero_variance=False),
        sandbox=SandboxConfig(state_dir=state, cgroup_parent=CGROUP_PARENT, **sandbox),
    )  # fmt: skip


async def check_ended(tmp_path: Path, summary: ServeSummary, *, completed: int,
                      failed: int) -> None:
    async with await Store.open(StoreConfig(url=f"sqlite:///{tmp_path / 'store.db'}")) as store:
        assert (await store.audit(summary.run_id)).problems() == []
    assert (summary.completed, summary.failed) == (completed, failed)


@pytest.fixture(autouse=True)
def _envs() -> None:
    register("test-holding-sandbox", HoldingEnv)
    register("test-unstartable-sandbox", UnstartableEnv)


async def test_max_sandboxes_caps_live_sandboxes_across_episodes(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path
) -> None:
    HoldingEnv.clear(hold_s=0.4)
    summary = await run(tmp_path, tiny_dense_model, state_dir, "test-holding-sandbox", 6,
                        concurrent=6, max_sandboxes=2)
    # Six episodes ran at once, two sandboxes at a time (default config: six).
    assert HoldingEnv.peak == 2
    stats = summary.sandboxes
    assert stats is not None and stats.peak_live == 2 and stats.created == 6
    await check_ended(tmp_path, summary, completed=6, failed=0)
    assert leftovers(state_dir) == []


async def test_warm_pool_starts_sandboxes_before_episodes_ask_and_replaces_them(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path
) -> None:
    HoldingEnv.clear(hold_s=1.0)  # time for the pool to start the next one in the background
    summary = await run(tmp_path, tiny_dense_model, state_dir, "test-holding-sandbox", 3,
                        concurrent=1, warm_pool=1)
    stats = summary.sandboxes
    assert stats is not None
    # Every episode got a sandbox started before it asked (default warm_pool: none did).
    assert stats.warm_hits == 3, stats
    assert stats.created >= 3 and stats.create_failures == 0
    await check_ended(tmp_path, summary, completed=3, failed=0)
    assert leftovers(state_dir) == []


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_create_concurrency_caps_creations_at_once(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path, concurrency: int
) -> None:
    HoldingEnv.clear(hold_s=0.2)
    summary = await run(tmp_path, tiny_dense_model, state_dir, "test-holding-sandbox", 4,
                        concurrent=4, create_concurrency=concurrency, create_jitter_s=0.0)
    stats = summary.sandboxes
    assert stats is not None and stats.created == 4
    # Four episodes asked at once: one creation at a time, or more than one (default: four).
    assert stats.peak_creating == 1 if concurrency == 1 else 2 <= stats.peak_creating <= concurrency
    await check_ended(tmp_path, summary, completed=4, failed=0)


async def test_create_jitter_spreads_creations(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path
) -> None:
    HoldingEnv.clear(hold_s=0.0)
    summary = await run(tmp_path, tiny_dense_model, state_dir, "test-holding-sandbox", 8,
                        concurrent=8, create_jitter_s=2.0, create_concurrency=8)
    stats = summary.sandboxes
    assert stats is not None and len(stats.create_started) == 8
    # Eight episodes asked at once; uniform delays over 2 s have a spread of about 0.58 s (the
    # default 0.05 s: about 0.015 s). Below 0.15 s needs all eight within ~0.5 s: p < 1e-3.
    assert statistics.pstdev(stats.create_started) >= 0.15, stats.create_started
    assert max(HoldingEnv.waits) >= 0.3  # some episode waited out a long delay
    await check_ended(tmp_path, summary, completed=8, failed=0)


async def test_a_sandbox_that_cannot_start_fails_its_episode_once(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path
) -> None:
    HoldingEnv.clear(hold_s=0.0)
    summary = await run(tmp_path, tiny_dense_model, state_dir, "test-unstartable-sandbox", 3,
                        concurrent=3, max_sandboxes=1)
    stats = summary.sandboxes
    assert stats is not None and stats.create_failures == 3 and stats.created == 0
    assert summary.endings.failed == {"SandboxError": 3}
    await check_ended(tmp_path, summary, completed=0, failed=3)
    assert UnstartableEnv.holding == 0 and leftovers(state_dir) == []


async def test_serve_shut_down_while_episodes_wait_for_sandboxes(
    tmp_path: Path, tiny_dense_model: Path, state_dir: Path
) -> None:
    """Cancelled with one episode holding the only sandbox and three waiting for it: all four
    end failed (interrupted), once each, and the pool closes every sandbox."""
    HoldingEnv.clear(hold_s=60.0)
    renderer = ChatRenderer(tiny_dense_model)
    async with StandInEngine([renderer.encode("413")], renderer.eos_id) as engine:
        cfg = config(tmp_path, tiny_dense_model, engine.url, "test-holding-sandbox", 4, state_dir,
                     max_sandboxes=1)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(serve, cfg, max_episodes=4))
                while HoldingEnv.holding < 1:
                    await anyio.sleep(0.05)
                await anyio.sleep(0.3)
                assert HoldingEnv.holding == 1  # the others wait for its slot
                tg.cancel_scope.cancel()
    assert HoldingEnv.holding == 0 and leftovers(state_dir) == []
    async with await Store.open(cfg.store) as store:
        run_id = await store.ensure_run(cfg.run.name, None)
        ledger = await store.ledger(run_id)
        assert (ledger.admitted, ledger.failed) == (4, 4), ledger
        assert (await store.audit(run_id)).problems() == []
