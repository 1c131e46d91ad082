"""Demonstrations rendered as text, a few per built-in environment: a corpus for tests that need
many realistic transcripts (the sandbox envs run in real sandboxes of the configured backend)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from agent_rl.config import load_config
from agent_rl.sdk.demonstrations import SandboxFactory, demonstrations, render_chatml
from agent_rl.sdk.messages import Message
from agent_rl.sdk.registry import make, specs
from agent_rl.sdk.sandbox import Sandbox, SandboxSpec
from tools_sandbox.factory import open_backend

Render = Callable[[list[Message], list[dict[str, Any]]], str]
"""Turns (messages, tool schemas) into text, e.g. by a tokenizer's chat template."""


@asynccontextmanager
async def configured_sandboxes() -> AsyncIterator[SandboxFactory]:
    """A sandbox factory on the backend the config names, closed with everything it made."""
    backend = await open_backend(load_config().sandbox)

    async def create(spec: SandboxSpec | None) -> Sandbox:
        return await backend.create(spec or SandboxSpec())

    try:
        yield create
    finally:
        await backend.aclose()


def sample_texts(env_id: str, n: int, *, seed: int = 0, render: Render | None = None) -> list[str]:
    """Texts of `n` demonstrated episodes of one env, rendered by `render(messages, tools)`
    or `render_chatml`."""
    draw = render or (lambda messages, tools: render_chatml(messages))

    async def go() -> list[str]:
        async with configured_sandboxes() as factory:
            transcripts = await demonstrations(env_id, n, seed=seed, sandbox_factory=factory)
        return [draw(t.messages, t.tools) for t in transcripts]

    return anyio.run(go)


def corpus_samples(
    n_per_env: int, *, seed: int = 0, env_ids: Iterable[str] | None = None,
    include_sandbox_envs: bool = True,
) -> Iterator[str]:
    """ChatML texts covering the built-in environments (or `env_ids`), `n_per_env` each."""
    ids = list(env_ids) if env_ids is not None else [
        s.id for s in specs() if s.source == "builtin" and s.id_argument is None
        and make(s.id).has_demonstration()
    ]
    for env_id in ids:
        if make(env_id).needs_sandbox and not include_sandbox_envs:
            continue
        yield from sample_texts(env_id, n_per_env, seed=seed)
