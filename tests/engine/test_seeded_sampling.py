"""Per-request sampling seeds on the CPU engine (shim 4 of agent_rl/engine/sglang_cpu): a seeded
request gives the same tokens every time, alone or batched beside other requests, seeded or
not; different seeds and unseeded requests still sample at random. `agent-rl eval` reruns rely
on it."""

from __future__ import annotations

import asyncio

from agent_rl.sglang.client import EngineClient
from agent_rl.engine.launcher import EngineServer

PARAMS = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}


def test_a_seed_gives_the_same_tokens_alone_and_batched(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            def gen(seed: int | None, prompt: list[int] = [5, 6, 7]):  # noqa: B006
                params = dict(PARAMS, **({} if seed is None else {"sampling_seed": seed}))
                return c.generate(prompt, params)

            alone = await gen(7)
            # Batched with unseeded requests (merged into a running batch, then alone again).
            batch = await asyncio.gather(gen(None), gen(7), gen(None), gen(8), gen(7, [9, 5, 6, 7]))
            again = await gen(7)
            unseeded = await asyncio.gather(*(gen(None) for _ in range(3)))
        assert alone.output_ids == batch[1].output_ids == again.output_ids
        assert batch[3].output_ids != alone.output_ids  # another seed
        assert len({tuple(g.output_ids) for g in [*unseeded, batch[0], batch[2]]}) >= 4
        assert alone.logprobs is not None and len(alone.logprobs) == 24

    asyncio.run(go())
