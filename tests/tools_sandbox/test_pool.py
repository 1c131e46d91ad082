"""The pool: warm sandboxes, the cap on live sandboxes, the live metric, reaping at open."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import REGISTRY

from agent_rl.sdk.sandbox import SandboxSpec
from agent_rl.kernel.errors import SandboxError
from tools_sandbox.pool import SandboxPool

from .conftest import backend_or_skip, sandbox_config, small_limits
from .helpers import leftovers

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(limits=small_limits())


def gauge(name: str, backend: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"backend": backend})


async def test_warm_pool_hands_out_started_sandboxes() -> None:
    backend_or_skip("bwrap")  # skips without root, like the other bwrap tests
    config = sandbox_config("bwrap", warm_pool=2, max_sandboxes=8)
    async with SandboxPool.open(config) as pool:
        await pool.prewarm(SPEC)
        assert pool.warm(SPEC) == 2 and pool.live() == 2
        assert gauge("agent_rl_sandboxes_live", "bwrap") == 2
        with anyio.fail_after(2):  # no start-up on the episode's path
            async with pool.sandbox(SPEC) as sb:
                assert (await sb.run_python("print(1)")).stdout == "1\n"
        with anyio.fail_after(30):
            while pool.warm(SPEC) < 2:  # refilled in the background
                await anyio.sleep(0.05)
        backend = pool.backend
    assert backend.live() == 0 and gauge("agent_rl_sandboxes_live", "bwrap") == 0
    assert leftovers(backend) == []


async def test_only_prewarmed_specs_are_kept_warm() -> None:
    """A spec no one prewarmed (an agent command's, with its episode's own relay mount) is
    made on demand: warm ones of it could never be used, and would hold slots until close."""
    backend_or_skip("bwrap")
    other = SandboxSpec(limits=small_limits(memory_mb=96))
    async with SandboxPool.open(sandbox_config("bwrap", warm_pool=2, max_sandboxes=8)) as pool:
        async with pool.sandbox(other):
            pass
        await anyio.sleep(0.5)  # what a background refill would have had time to start
        assert pool.warm() == 0 and pool.live() == 0


async def test_a_closed_pool_refuses_and_wakes_its_waiters() -> None:
    backend_or_skip("bwrap")
    async with SandboxPool.open(sandbox_config("bwrap", max_sandboxes=1)) as pool:
        held = await pool.acquire(SPEC)
        refused: list[str] = []

        async def wait_for_a_slot() -> None:
            with pytest.raises(SandboxError, match="closed") as e:
                await pool.acquire(SPEC)
            refused.append(str(e.value))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_a_slot)
            await anyio.sleep(0.2)
            await pool.aclose()
            await pool.release(held)  # the episode holding the slot ends: its waiter is refused
        assert len(refused) == 1 and pool.live() == 0
        with pytest.raises(SandboxError, match="closed"):
            await pool.acquire(SPEC)
        backend = pool.backend
    assert leftovers(backend) == []


async def test_cap_on_live_sandboxes() -> None:
    backend_or_skip("bwrap")
    async with SandboxPool.open(sandbox_config("bwrap", max_sandboxes=2)) as pool:
        a = await pool.acquire(SPEC)
        b = await pool.acquire(SPEC)
        with anyio.move_on_after(0.5) as scope:
            await pool.acquire(SPEC)
        assert scope.cancelled_caught, "a third sandbox started beyond max_sandboxes=2"
        await pool.release(a)
        with anyio.fail_after(30):
            c = await pool.acquire(SPEC)
        assert pool.live() == 2
        await pool.release(b)
        await pool.release(c)
        assert pool.live() == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bwrap", "docker"])
async def test_concurrent_episodes_through_the_pool(name: str) -> None:
    """Episodes far beyond the cap all complete; creations are capped and jittered."""
    backend_or_skip(name)
    episodes = 24 if name == "bwrap" else 8
    config = sandbox_config(name, max_sandboxes=8, warm_pool=1, create_concurrency=2)
    done: list[int] = []

    async def episode(i: int, pool: SandboxPool) -> None:
        async with pool.sandbox(SPEC) as sb:
            r = await sb.run_python(f"{i} * 2")
            assert r.ok, r
            done.append(int(r.value or 0))
            assert pool.live() <= 8

    with anyio.fail_after(150):
        async with SandboxPool.open(config) as pool:
            async with anyio.create_task_group() as tg:
                for i in range(episodes):
                    tg.start_soon(episode, i, pool)
            backend = pool.backend
    assert sorted(done) == [2 * i for i in range(episodes)]
    assert leftovers(backend) == []
