"""Demonstrations: an environment's teacher policy played through the environment itself.

`run_demonstration(env, task)` is the episode loop without tokens: the env's `demonstrate`
writes each completion as text, exactly as a model should, and that text goes through the
same `parse_completion` and `env.step` the episode runner uses. So a transcript with full
reward proves the env, its tools (in a real sandbox when it needs one), the parser and the
reward agree; and the transcripts are supervised warm-start data (the assistant messages'
content is the raw completion text, tool-call markup included).

A teacher that needs what happened so far in structured form (its own calls, their results)
declares a `history` parameter: `async def demonstrate(self, messages, history)`. It then gets
one `DemoTurn` per earlier step (the parsed completion and the env's `StepResult`), so it never
re-parses its own text; `demonstrate(self, messages)` keeps working as before.

A demonstration runs for `max_turns` turns when the caller gives it, else to the env's own
limit (`Env.max_turns`), else `DEFAULT_MAX_TURNS`; one that ends without the env's natural end
(cut by that limit or by the env's own truncation) is `Transcript.cut`, for callers to count.

`render_chatml` renders a transcript as ChatML text in the project's template convention.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from agent_rl.sdk.env import Env, StepInfo, StepResult
from agent_rl.kernel.errors import EnvError
from agent_rl.sdk.messages import AssistantTurn, Message
from agent_rl.sdk.registry import make
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import parse_completion

if TYPE_CHECKING:
    from agent_rl.sdk.sandbox import Sandbox, SandboxSpec

DEFAULT_MAX_TURNS = 16
"""Turns of a demonstration when neither the env nor the caller sets a limit."""

SandboxFactory = Callable[["SandboxSpec | None"], Awaitable["Sandbox"]]
"""Makes one sandbox for an episode from the env's `sandbox_spec` (None: the default spec)."""
TextPolicy = Callable[..., Awaitable[str]]
"""Writes the next completion text for a conversation (a teacher, a scripted test policy):
`policy(messages)`, or `policy(messages, history=[DemoTurn, ...])` when it has a `history`
parameter."""


class DemoTurn(BaseModel):
    """One earlier step of the episode, structured: what a teacher would otherwise re-parse."""

    turn: AssistantTurn
    """The completion as `parse_completion` read it: content and calls, each `ToolCall` with its
    parsed `arguments` and its `raw_arguments` text."""
    result: StepResult
    """The env's answer: observations, `info.tool_results` (each call's output and error),
    `info.malformed`, reward and whether it ended."""


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

    @property
    def cut(self) -> bool:
        """Ended by a limit (turns, the env's truncation) before the episode's natural end."""
        return self.truncated and not self.terminated

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
    max_turns: int | None = None,
) -> Transcript:
    """Play `env.demonstrate` through `env` on `task`, for at most `max_turns` turns (unset: the
    env's own `max_turns`, else `DEFAULT_MAX_TURNS`); the env's errors propagate as EnvError."""
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
    max_turns: int | None = None,
) -> Transcript:
    """One episode at the text level: `policy(messages)` writes each completion, which goes
    through `parse_completion` and `env.step` as in the token-level runner. For
    demonstrations, evaluations of text-only policies, and tests. At most `max_turns` turns
    (unset: the env's own `max_turns`, else `DEFAULT_MAX_TURNS`)."""
    max_turns = max_turns or env.max_turns or DEFAULT_MAX_TURNS
    first = await env.reset(task, seed, sandbox=sandbox)
    messages: list[Message] = list(first.messages)
    steps: list[StepInfo] = []
    history: list[DemoTurn] = []
    with_history = takes_history(policy)
    reward, terminated, truncated = 0.0, False, False
    try:
        for turn_no in range(max_turns):
            if with_history:
                text = await policy(list(messages), history=list(history))
            else:
                text = await policy(list(messages))
            turn = parse_completion(text, id_prefix=f"call_{turn_no}_")
            messages.append(turn.to_message())
            result = await env.step(turn)
            messages.extend(result.observations)
            steps.append(result.info)
            history.append(DemoTurn(turn=turn, result=result))
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


def takes_history(policy: Callable[..., Any]) -> bool:
    """Whether a text policy (an env's `demonstrate`) declares the `history` parameter."""
    try:
        parameters = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False
    return "history" in parameters


async def demonstrations(
    env_id: str,
    n: int,
    *,
    seed: int = 0,
    split: str = "train",
    sandbox_factory: SandboxFactory | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    max_turns: int | None = None,
) -> list[Transcript]:
    """Transcripts of the first `n` tasks of `env_id` (made with `env_kwargs`) for `seed`, each
    of at most `max_turns` turns (unset: the env's own limit, else `DEFAULT_MAX_TURNS`).

    Sandbox envs get one sandbox per episode from `sandbox_factory`, closed afterwards.
    """
    env = make(env_id, **dict(env_kwargs or {}))
    if env.needs_sandbox and sandbox_factory is None:
        raise EnvError(
            f"{env_id} runs its tools in a sandbox: pass sandbox_factory= to demonstrations"
        )
    out = []
    for i, task in enumerate(env.task_source(split).take(n, seed)):
        sandbox = None
        if env.needs_sandbox and sandbox_factory is not None:
            sandbox = await sandbox_factory(env.sandbox_spec)
        try:
            out.append(await run_demonstration(env, task, seed=seed + i, sandbox=sandbox,
                                               max_turns=max_turns))
        finally:
            if sandbox is not None:
                await sandbox.close()
    return out


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
