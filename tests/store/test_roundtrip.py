"""Property tests: any episode written through the store reads back bit for bit."""

from __future__ import annotations

import time

from anyio.from_thread import start_blocking_portal
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agent_rl.store import MessageRecord, TokenArrays, TurnRecord
from tests.store.helpers import migrated_store

logprob = st.one_of(
    st.floats(width=32, allow_nan=False),
    st.sampled_from([-np.inf, np.inf, 0.0, -0.0, np.float32(1e-45), -np.float32(1.4e-45), np.nan]),
)


@st.composite
def spans(draw: st.DrawFn, layers: int | None) -> TokenArrays:
    n = draw(st.integers(0, 40))
    experts = None
    if layers is not None:
        experts = draw(hnp.arrays(np.int32, (n, layers, 2), elements=st.integers(0, 127)))
    return TokenArrays.build(
        token_ids=draw(hnp.arrays(np.int32, n, elements=st.integers(0, 2**31 - 1))),
        logprobs=draw(hnp.arrays(np.float32, n, elements=logprob)),
        loss_mask=draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1))),
        versions=draw(hnp.arrays(np.int32, n, elements=st.integers(-1, 1000))),
        routed_experts=experts,
    )


@st.composite
def episodes(draw: st.DrawFn) -> list[TokenArrays]:
    layers = draw(st.sampled_from([None, 1, 3]))
    return draw(st.lists(spans(layers), min_size=1, max_size=5))


@pytest.mark.parametrize("compress", [False, True])
def test_any_episode_round_trips(db_url: str, compress: bool) -> None:
    examples = 40 if db_url.startswith("sqlite") else 25

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(turns=episodes())
    def check(turns: list[TokenArrays]) -> None:
        portal.call(_write_and_read, turns)

    async def _write_and_read(turns: list[TokenArrays]) -> None:
        run = await store.ensure_run("prop")
        task = await store.add_task(run, "env", "0", {"x": 1})
        _, (episode,) = await store.admit_group(run, task, "env", 1)
        await store.start_episode(episode, "prop")
        for i, tokens in enumerate(turns):
            t = time.time()
            await store.append_turn(
                episode,
                TurnRecord(tokens=tokens, num_prompt_tokens=min(1, len(tokens)), started_at=t,
                           finished_at=t, messages=[MessageRecord("assistant", f"turn {i} \u2603")]),
            )
        await store.finish_episode(episode, 0.5)
        back = await store.episode_tokens(episode)
        assert back == TokenArrays.concat(turns)
        detail = await store.get_episode(episode)
        assert [t.num_tokens for t in detail.turns] == [len(t) for t in turns]
        assert detail.episode.num_tokens == sum(len(t) for t in turns)
        assert [m["content"] for m in detail.messages] == [f"turn {i} \u2603" for i in range(len(turns))]

    # One event loop for the whole test: pooled connections belong to the loop that made them.
    with start_blocking_portal() as portal:
        store = portal.call(lambda: migrated_store(db_url, compress_tokens=compress))
        try:
            check()
        finally:
            portal.call(store.close)


def test_arrays_must_align() -> None:
    with pytest.raises(ValueError, match="logprobs has 2 entries"):
        TokenArrays.build([1, 2, 3], [0.0, 0.0], [0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="routed_experts"):
        TokenArrays.build([1], [0.0], [1], [0], routed_experts=np.zeros((2, 1, 2)))
