"""`Env`: the environment base class, async and Gymnasium-shaped, speaking chat messages.

Lifecycle (one instance runs one episode at a time; make one per concurrent episode):

    env = make("calculator")
    first = await env.reset(task, seed, sandbox=sandbox)   # ResetResult: messages + tool schemas
    while True:
        turn = parse_completion(completion_text)           # AssistantTurn
        result = await env.step(turn)                      # StepResult
        if result.terminated or result.truncated: break
        # append turn.to_message() and result.observations to the conversation
    await env.close()

The default `step` is a tool loop: a turn with tool calls runs them (in order, in the episode's
sandbox for sandbox tools) and answers with one tool message per call, malformed calls
included; a turn without calls is the final answer and is scored by `score`. Subclasses
implement `score`, `initial_messages` unless their tasks carry a `question` (asked as one user
message by default), usually `builtin_tasks`, optionally `demonstrate` (a teacher policy for
supervised warm-start and tests) and `group_reward`; they may override `reset`/`step` entirely
for other dynamics.

User code never crashes the caller with an arbitrary exception: every lifecycle method of
every subclass is wrapped so that anything but `EnvError`/`SandboxError` leaves it as
`EnvCodeError` (an `EnvError`) carrying the env id, the method, and the original traceback.
"""

from __future__ import annotations

import functools
import inspect
import random
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, Field

from agent_rl.kernel.errors import EnvError, SandboxError
from agent_rl.sdk.messages import (
    AssistantTurn,
    MalformedToolCall,
    Message,
    ToolCall,
    system,
    tool_message,
    user,
)
from agent_rl.sdk.rewards import EpisodeOutcome, Reward, as_reward
from agent_rl.sdk.tasks import JsonlTasks, Task, TaskSource
from agent_rl.sdk.tools import Tool, ToolResult, run_tool_call

if TYPE_CHECKING:
    from agent_rl.sdk.sandbox import Sandbox, SandboxSpec


class EnvCodeError(EnvError):
    """Environment code raised; carries where and the original traceback."""

    def __init__(self, env_id: str, method: str, error: BaseException, tb: str) -> None:
        super().__init__(f"{env_id}.{method} raised {type(error).__name__}: {error}")
        self.env_id, self.method, self.traceback = env_id, method, tb


class ResetResult(BaseModel):
    """What an episode starts from."""

    messages: list[Message]
    """The initial conversation (system and/or user messages)."""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """OpenAI-style schemas of the tools the model may call (`tools=` of a chat template)."""


class StepInfo(BaseModel):
    """Typed record of what happened in one step."""

    tool_results: list[ToolResult] = Field(default_factory=list)
    malformed: list[MalformedToolCall] = Field(default_factory=list)
    reward: Reward | None = None
    """The episode's score breakdown, on the step that scored it."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific JSON-serializable details."""


class StepResult(BaseModel):
    """The environment's answer to one assistant turn."""

    observations: list[Message] = Field(default_factory=list)
    """Messages to append after the assistant turn (tool results, user feedback)."""
    reward: float = 0.0
    terminated: bool = False
    """The episode reached its natural end (an answer was given and scored)."""
    truncated: bool = False
    """The episode was cut short by the environment's own limit (max_turns)."""
    info: StepInfo = Field(default_factory=StepInfo)


# Methods wrapped so that user errors surface as EnvCodeError.
_GUARDED = (
    "reset", "step", "close", "initial_messages", "score", "demonstrate",
    "builtin_tasks", "task_source", "group_reward", "build_tools", "sampling_params",
)  # fmt: skip


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "__agent_rl_guarded__", False):
        return fn

    def convert(self: Env, e: Exception) -> EnvError:
        return EnvCodeError(self.env_id, name, e, traceback.format_exc())

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(self: Env, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            except (EnvError, SandboxError):
                raise
            except Exception as e:
                raise convert(self, e) from e

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(fn)
        def sync_wrapper(self: Env, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except (EnvError, SandboxError):
                raise
            except Exception as e:
                raise convert(self, e) from e

        wrapper = sync_wrapper
    wrapper.__agent_rl_guarded__ = True  # type: ignore[attr-defined]
    return wrapper


class Env:
    """Base class of every environment. See the module docstring for the lifecycle."""

    tools: ClassVar[Sequence[Tool]] = ()
    """Function tools of this environment; `@tool` methods on the class are added to them."""
    sandbox_spec: ClassVar[SandboxSpec | None] = None
    """The sandbox this env wants (None: the backend's default, if it needs one at all)."""
    uses_sandbox: ClassVar[bool] = False
    """Set when `score` runs a verifier in the sandbox even though no tool needs one."""
    resumable: ClassVar[bool] = True
    """When the serve running an episode dies, another serve resumes it: it makes the env
    again, re-runs the stored assistant turns through `step` and checks each observation
    against the stored one (a mismatch fails the episode as interrupted), then generates on.
    Set False for an env whose steps cannot be re-run (real side effects, randomness not
    drawn from `self.rng`): its interrupted episodes then fail."""
    env_id: str
    """The registry id this instance was made as (the class name when built directly)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _GUARDED:
            if name in cls.__dict__:
                setattr(cls, name, _guard(name, cls.__dict__[name]))

    def __init__(self, *, tasks: str | Path | None = None, max_turns: int | None = None,
                 system_prompt: str | None = None, tools_in_prompt: bool = True) -> None:  # fmt: skip
        """`tasks`: a JSONL file replacing the built-in task set; `max_turns`: assistant turns
        before the env truncates the episode; `system_prompt`: prepended as a system message;
        `tools_in_prompt=False`: `reset` lists no tool schemas for the chat template (the tools
        still run), for a model trained to call them without reading their schemas, e.g. the
        quickstart's tiny one, for which the schemas would be most of every sequence."""
        self.env_id = type(self).__name__
        self.task_file = Path(tasks) if tasks is not None else None
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.tools_in_prompt = tools_in_prompt
        self.task: Task | None = None
        self.seed: int | None = None
        self.rng = random.Random(0)
        self.sandbox: Sandbox | None = None
        self.turns = 0
        self.done = False
        """The episode ended (terminated or truncated); `step` refuses until the next reset."""
        self._toolset: dict[str, Tool] | None = None

    # ------------------------------------------------------------------ tools

    def build_tools(self) -> list[Tool]:
        """This instance's tools: `tools`, then `@tool` methods (bound), base classes' first;
        override to vary them. A subclass that redefines an inherited `@tool` method replaces
        it (as any method override does), and one that sets the name to something that is not
        a tool (e.g. `probe = None`) removes it."""
        attributes: dict[str, None] = {}  # every @tool attribute name, in definition order
        for klass in reversed(type(self).__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, Tool):
                    attributes.setdefault(name)
        found: list[Tool] = list(type(self).tools)
        for name in attributes:
            if isinstance(inspect.getattr_static(type(self), name, None), Tool):
                found.append(getattr(self, name))
        return found

    @property
    def toolset(self) -> dict[str, Tool]:
        """Tools by name (built once per instance)."""
        if self._toolset is None:
            tools: dict[str, Tool] = {}
            for t in self.build_tools():
                if t.name in tools and tools[t.name] is not t:
                    raise EnvError(f"{self.env_id}: two tools are named {t.name!r}: rename one")
                tools[t.name] = t
            self._toolset = tools
        return self._toolset

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.toolset.values()]

    @property
    def needs_sandbox(self) -> bool:
        """True if the runner must give `reset` a sandbox."""
        return self.uses_sandbox or any(t.needs_sandbox for t in self.toolset.values())

    async def call_tool(self, call: ToolCall) -> ToolResult:
        """Run one call with this episode's sandbox; failures become the result's output."""
        return await run_tool_call(self.toolset, call, sandbox=self.sandbox)

    # ------------------------------------------------------------------ tasks

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        """The env's own task set; envs without one are given `tasks=FILE.jsonl`."""
        raise EnvError(f"{self.env_id} has no built-in tasks: pass tasks=PATH.jsonl")

    def task_source(self, split: str = "train") -> TaskSource:
        """The task file given at construction if any, else `builtin_tasks(split)`."""
        if self.task_file is not None:
            return JsonlTasks(self.task_file)
        return self.builtin_tasks(split)

    # ------------------------------------------------------------------ lifecycle

    async def reset(
        self, task: Task, seed: int | None = None, *, sandbox: Sandbox | None = None
    ) -> ResetResult:
        """Start an episode on `task`. Sandbox tools and verifiers use `sandbox`."""
        if self.needs_sandbox and sandbox is None:
            raise EnvError(f"{self.env_id} needs a sandbox: pass sandbox= to reset")
        self.task, self.seed, self.sandbox, self.turns, self.done = task, seed, sandbox, 0, False
        self.rng = random.Random(f"{task.id}:{seed}")
        messages = list(await _maybe_await(self.initial_messages(task)))
        if self.system_prompt is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, system(self.system_prompt))
        return ResetResult(messages=messages, tools=self.tool_schemas() if self.tools_in_prompt else [])

    async def step(self, turn: AssistantTurn) -> StepResult:
        """Run the turn's tool calls, or score its content when it has none."""
        if self.task is None:
            raise EnvError(f"{self.env_id}.step called before reset")
        if self.done:
            raise EnvError(f"{self.env_id}.step called after the episode ended: reset first")
        self.turns += 1
        if not turn.has_calls:
            self.done = True
            reward = as_reward(await self.score(turn.content))
            return StepResult(reward=reward.value, terminated=True, info=StepInfo(reward=reward))
        observations: list[Message] = []
        results: list[ToolResult] = []
        for call in turn.calls:
            if isinstance(call, MalformedToolCall):
                observations.append(tool_message(call.observation()))
                continue
            result = await self.call_tool(call)
            results.append(result)
            observations.append(tool_message(result.output, call_id=call.id, name=call.name))
        truncated = self.max_turns is not None and self.turns >= self.max_turns
        self.done = truncated
        return StepResult(
            observations=observations, truncated=truncated,
            info=StepInfo(tool_results=results, malformed=turn.malformed),
        )  # fmt: skip

    async def close(self) -> None:
        """Release what the episode holds (the sandbox belongs to the runner, not the env)."""
        self.sandbox = None

    # ------------------------------------------------------------------ hooks for subclasses

    def initial_messages(self, task: Task) -> list[Message]:
        """The conversation the model starts from (may be async). By default the task's
        `question` as one user message; override for anything else."""
        if "question" not in task.data:
            raise NotImplementedError(
                f"{type(self).__name__} must implement initial_messages(task): its tasks have "
                "no 'question' to ask by default"
            )
        return [user(task["question"])]

    async def score(self, answer: str) -> Reward | float:
        """Reward of the final answer for `self.task` (a rule, or a verifier in `self.sandbox`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(answer)")

    async def demonstrate(self, messages: list[Message]) -> str:
        """The teacher's next completion text for the conversation so far (privileged: it may
        read `self.task`). Used for supervised warm-start data and for tests. A teacher that
        declares a `history` keyword parameter also gets its earlier turns as parsed turns with
        their step results (`agent_rl.sdk.demonstrations.DemoTurn`), so it need not re-parse its own text."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstration policy")

    @classmethod
    def has_demonstration(cls) -> bool:
        return cls.demonstrate is not Env.demonstrate

    def sampling_params(self) -> dict[str, Any]:
        """Overrides of the rollout's sampling parameters for the next generation (asked
        before each turn; SGLang's names, e.g. `{"max_new_tokens": 512}` for a final answer,
        `min_new_tokens`, `stop`). A `max_new_tokens` asked for is capped by
        `rollout.max_new_tokens` and the episode's token budget; a completion that ends at the
        length the env asked for is stepped as usual, one that ends at a cap is a truncation."""
        return {}

    async def group_reward(self, outcomes: list[EpisodeOutcome]) -> list[float] | None:
        """Rewards for a finished group of episodes on one task; None keeps their own."""
        return None

    @classmethod
    def has_group_reward(cls) -> bool:
        return cls.group_reward is not Env.group_reward


# The base class's own hooks are guarded too: a subclass that forgot `score` gets an EnvError.
for _name in _GUARDED:
    setattr(Env, _name, _guard(_name, Env.__dict__[_name]))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
