"""Demonstrations: an environment's teacher policy played through the environment itself.

`run_demonstration(env, task)` is the episode loop without tokens: the env's `demonstrate`
writes each completion as text, exactly as a model should, and that text goes through the
same `parse_completion` and `env.step` the episode runner uses. So a transcript with full
reward proves the env, its tools (in a real sandbox when it needs one), the parser and the
reward agree; and the transcripts are supervised warm-start data (the assistant messages'
content is the raw completion text, tool-call markup included).

`sample_texts(env_id, n)` and `corpus_samples()` render transcripts as ChatML text for
training a tokenizer that covers the built-in environments (the sandbox ones run in real
sandboxes of the configured backend).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel, Field

from agent_rl.env import Env, StepInfo
from agent_rl.messages import Message
from agent_rl.registry import make, specs
from agent_rl.rollout.tool_calls import parse_completion
from agent_rl.tasks import Task

if TYPE_CHECKING:
    from tools_sandbox.base import Sandbox, SandboxSpec

SandboxFactory = Callable[["SandboxSpec | None"], Awaitable["Sandbox"]]
"""Makes one sandbox for an episode from the env's `sandbox_spec` (None: the default spec)."""
TextPolicy = Callable[[list[Message]], Awaitable[str]]
"""Writes the next completion text for a conversation (a teacher, a scripted test policy)."""
Render = Callable[[list[Message], list[dict[str, Any]]], str]
"""Turns (messages, tool schemas) into text, e.g. by a tokenizer's chat template."""


class Transcript(BaseModel):
    """One demonstrated episode."""

    env_id: str
    task: Task
    seed: int | None
    messages: list[Message]
    """The whole conversation: initial messages, assistant turns (raw text), observations."""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    reward: float
    terminated: bool
    truncated: bool
    steps: list[StepInfo] = Field(default_factory=list)

    def completions(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "assistant"]

    def chatml(self, *, with_tools: bool = False) -> str:
        return render_chatml(self.messages, self.tools if with_tools else None)


async def run_demonstration(
    env: Env,
    task: Task,
    *,
    seed: int | None = 0,
    sandbox: Sandbox | None = None,
    max_turns: int = 16,
) -> Transcript:
    """Play `env.demonstrate` through `env` on `task`; the env's errors propagate as EnvError."""
    return await run_text_episode(
        env, task, env.demonstrate, seed=seed, sandbox=sandbox, max_turns=max_turns
    )


async def run_text_episode(
    env: Env,
    task: Task,
    policy: TextPolicy,
    *,
    seed: int | None = 0,
    sandbox: Sandbox | None = None,
    max_turns: int = 16,
) -> Transcript:
    """One episode at the text level: `policy(messages)` writes each completion, which goes
    through `parse_completion` and `env.step` as in the token-level runner. For
    demonstrations, evaluations of text-only policies, and tests."""
    first = await env.reset(task, seed, sandbox=sandbox)
    messages: list[Message] = list(first.messages)
    steps: list[StepInfo] = []
    reward, terminated, truncated = 0.0, False, False
    try:
        for turn_no in range(max_turns):
            text = await policy(list(messages))
            turn = parse_completion(text, id_prefix=f"call_{turn_no}_")
            messages.append(turn.to_message())
            result = await env.step(turn)
            messages.extend(result.observations)
            steps.append(result.info)
            reward += result.reward
            terminated, truncated = result.terminated, result.truncated
            if terminated or truncated:
                break
        else:
            truncated = True
    finally:
        await env.close()
    return Transcript(
        env_id=env.env_id, task=task, seed=seed, messages=messages, tools=first.tools,
        reward=reward, terminated=terminated, truncated=truncated, steps=steps,
    )  # fmt: skip


async def demonstrations(
    env_id: str,
    n: int,
    *,
    seed: int = 0,
    split: str = "train",
    sandbox_factory: SandboxFactory | None = None,
    **env_kwargs: Any,
) -> list[Transcript]:
    """Transcripts of the first `n` tasks of `env_id`'s task stream for `seed`.

    Sandbox envs get one sandbox per episode from `sandbox_factory` (closed afterwards), or
    from the configured backend (`[sandbox]` in the config) when none is given.
    """
    env = make(env_id, **env_kwargs)
    if env.needs_sandbox and sandbox_factory is None:
        async with configured_sandboxes() as factory:
            return await demonstrations(
                env_id, n, seed=seed, split=split, sandbox_factory=factory, **env_kwargs
            )
    out = []
    for i, task in enumerate(env.task_source(split).take(n, seed)):
        sandbox = None
        if env.needs_sandbox and sandbox_factory is not None:
            sandbox = await sandbox_factory(env.sandbox_spec)
        try:
            out.append(await run_demonstration(env, task, seed=seed + i, sandbox=sandbox))
        finally:
            if sandbox is not None:
                await sandbox.close()
    return out


def sample_texts(
    env_id: str,
    n: int,
    *,
    seed: int = 0,
    render: Render | None = None,
    sandbox_factory: SandboxFactory | None = None,
) -> list[str]:
    """Texts of `n` demonstrated episodes of one env (sync, for tokenizer training), rendered
    by `render(messages, tools)` (e.g. a tokenizer's chat template) or `render_chatml`."""
    draw = render or (lambda messages, tools: render_chatml(messages))

    async def go() -> list[str]:
        transcripts = await demonstrations(env_id, n, seed=seed, sandbox_factory=sandbox_factory)
        return [draw(t.messages, t.tools) for t in transcripts]

    return anyio.run(go)


def corpus_samples(
    n_per_env: int = 200,
    *,
    seed: int = 0,
    env_ids: Iterable[str] | None = None,
    include_sandbox_envs: bool = True,
    render: Render | None = None,
    sandbox_factory: SandboxFactory | None = None,
) -> Iterator[str]:
    """ChatML texts covering the built-in environments (or `env_ids`), `n_per_env` each.

    Sandbox environments run in real sandboxes (`sandbox_factory`, else the configured
    backend); `include_sandbox_envs=False` leaves them out where no sandbox can run.
    """
    ids = list(env_ids) if env_ids is not None else [s.id for s in specs() if s.source == "builtin"]
    for env_id in ids:
        if make(env_id).needs_sandbox and not include_sandbox_envs:
            continue
        yield from sample_texts(
            env_id, n_per_env, seed=seed, render=render, sandbox_factory=sandbox_factory
        )


@asynccontextmanager
async def configured_sandboxes() -> AsyncIterator[SandboxFactory]:
    """A sandbox factory on the backend the config names, closed with everything it made."""
    from agent_rl.config import load_config
    from tools_sandbox.base import SandboxSpec
    from tools_sandbox.factory import open_backend

    backend = await open_backend(load_config().sandbox)

    async def create(spec: SandboxSpec | None) -> Sandbox:
        return await backend.create(spec or SandboxSpec())

    try:
        yield create
    finally:
        await backend.aclose()


def render_chatml(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
    """ChatML in the project's template convention (agent_rl/models/chat_template.jinja): every
    tool message is its own user turn wrapped in `<tool_response>`, so appending a message never
    changes the text before it; tool schemas, if given, go in a system message."""
    parts: list[str] = []
    msgs = list(messages)
    if tools:
        sys_text = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else ""
        schema_lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        sys_text += (
            ("\n\n" if sys_text else "") + "# Tools\n\nYou may call one or more functions.\n\n"
            f"<tools>\n{schema_lines}\n</tools>\n\nFor each call, return "
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
        )
        parts.append(f"<|im_start|>system\n{sys_text}<|im_end|>\n")
    for m in msgs:
        if m["role"] == "tool":
            parts.append(
                f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n"
            )
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(parts)
