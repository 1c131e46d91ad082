"""`agent-rl train --sft`'s data, as the library builds it (agent_rl/rollout/sft_data.py): how
many demonstrations a run needs, the configured env's demonstrations encoded with the model's
chat template, and an env that needs sandboxes run in ones of a real backend (bubblewrap, the
configured default) that the caller opens and the collection closes."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from agent_rl.config import Config, SandboxConfig
from agent_rl.config.trainer import SftConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.rollout.sft_data import (
    demonstration_sequences,
    demonstrations_needed,
    sft_sequences,
)
from agent_rl.sdk.sandbox import SandboxBackend
from tools_sandbox.factory import open_backend


def test_a_run_needs_its_steps_of_demonstrations_at_most_sft_demos() -> None:
    sft = SftConfig(batch_size=4, steps=10, demos=32)
    assert demonstrations_needed(sft) == 32  # 40 would be used; the run cycles through 32
    assert demonstrations_needed(sft, steps=3) == 12
    assert demonstrations_needed(SftConfig(batch_size=4, steps=5, demos=32)) == 20


def test_an_env_without_sandboxes_never_opens_a_backend(tiny_dense_model: Path) -> None:
    cfg = Config(trainer={"seed": 3})
    opened: list[int] = []

    async def opener() -> SandboxBackend:
        opened.append(1)
        raise AssertionError("calculator needs no sandbox")

    data = asyncio.run(sft_sequences(cfg, tiny_dense_model, "calculator", 4,
                                     open_sandboxes=opener))
    assert opened == [] and data.skipped == 0 and len(data.sequences) == 4
    # The configured seed picks the tasks: the same sequences as asked for directly.
    same = asyncio.run(demonstration_sequences("calculator", 4, tiny_dense_model, seed=3))
    other = asyncio.run(demonstration_sequences("calculator", 4, tiny_dense_model, seed=4))
    assert data.sequences == same.sequences != other.sequences


def test_a_sandbox_env_runs_in_the_given_backend_which_is_closed_after(
    tiny_dense_model: Path,
) -> None:
    state = Path(tempfile.mkdtemp(prefix="agent-rl-sft-data-"))
    state.chmod(0o711)  # sandbox uids must traverse it to reach their work dirs
    backends: list[SandboxBackend] = []

    async def opener() -> SandboxBackend:
        backend = await open_backend(SandboxConfig(state_dir=state))
        backends.append(backend)
        return backend

    try:
        data = asyncio.run(sft_sequences(Config(), tiny_dense_model, "python-math", 2,
                                         open_sandboxes=opener))
        assert len(backends) == 1 and backends[0].live() == 0  # no sandbox left open
        assert len(data.sequences) + data.skipped == 2 and data.sequences
        with pytest.raises(ConfigError, match="python-math run in sandboxes"):
            asyncio.run(sft_sequences(Config(), tiny_dense_model, "python-math", 2))
    finally:
        shutil.rmtree(state, ignore_errors=True)


LONG_SEARCH = {"turns_median": 20.0, "sibling_sigma": 0.5, "task_pool": 8, "max_turns": 30,
               "length_median": 4.0, "sigma": 0.5}
"""`long-tail` shaped like issue 49's searcher: episodes of a few to 30 turns, the env's own
`max_turns = 30` (rollout.max_turns stays at its default, 8)."""


def test_demonstrations_run_to_the_envs_own_max_turns_and_the_cut_ones_are_counted(
    tiny_dense_model: Path,
) -> None:
    """The env's limit is 30 turns: demonstrations run up to 30 (the SDK's default of 16 and
    rollout.max_turns of 8 cut them before), and the ones that end at the limit before their
    end are counted and left out; a smaller `max_turns` given wins and cuts more."""
    from agent_rl.sdk.demonstrations import demonstrations

    cfg = Config(rollout={"env_kwargs": LONG_SEARCH})
    transcripts = asyncio.run(demonstrations("long-tail", 16, env_kwargs=LONG_SEARCH))
    turns = [len(t.completions()) for t in transcripts]
    cut = sum(t.cut for t in transcripts)
    assert max(turns) == 30 and 0 < cut < 16
    assert all(t.cut == (n == 30 and t.reward == 0.0) for t, n in zip(transcripts, turns))
    whole = [n for t, n in zip(transcripts, turns) if not t.cut]
    assert max(whole) > 16  # longer than the old fixed limit, and trained
    data = asyncio.run(sft_sequences(cfg, tiny_dense_model, "long-tail", 16))
    assert (data.cut, data.max_turns, len(data.sequences)) == (cut, 30, 16 - cut)
    fewer = asyncio.run(sft_sequences(cfg, tiny_dense_model, "long-tail", 16, max_turns=12))
    assert fewer.max_turns == 12 and fewer.cut == sum(n > 12 or t.cut
                                                       for t, n in zip(transcripts, turns))
    with pytest.raises(ConfigError, match="all 4 demonstrations of long-tail were cut"):
        asyncio.run(sft_sequences(cfg, tiny_dense_model, "long-tail", 4, max_turns=1))
