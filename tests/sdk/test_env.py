"""The Env lifecycle: reset/step through the default tool loop, and user errors as EnvError."""

from __future__ import annotations

import pytest

from agent_rl import Env, EnvCodeError, EnvError, EpisodeOutcome, Reward, Task, tool
from agent_rl.sdk.messages import Message, user
from agent_rl.rollout.scheduler import apply_group_reward
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion

pytestmark = pytest.mark.anyio


@tool
def shout(text: str) -> str:
    """Upper-case text.

    Args:
        text: What to shout.
    """
    if text == "fail":
        raise RuntimeError("cannot shout that")
    return text.upper()


class EchoEnv(Env):
    """Answer with the task's word in capitals."""

    tools = (shout,)

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(f"Shout {task['word']}")]

    async def score(self, answer: str) -> Reward:
        assert self.task is not None
        ok = float(answer == self.task["word"].upper())
        return Reward(value=ok, components={"ok": ok}, detail="compared")

    async def group_reward(self, outcomes: list[EpisodeOutcome]) -> list[float] | None:
        # Bonus for the shortest correct episode: a real use of the hook.
        correct = [o for o in outcomes if o.reward > 0]
        if not correct:
            return None
        best = min(o.turns for o in correct)
        return [o.reward + (0.5 if o.reward > 0 and o.turns == best else 0.0) for o in outcomes]


TASK = Task(id="t0", data={"word": "hi"})


async def test_tool_loop_then_scored_answer() -> None:
    env = EchoEnv(system_prompt="Be loud.")
    first = await env.reset(TASK, seed=3)
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.tools == [shout.schema()] and not env.needs_sandbox

    turn = parse_completion(
        "thinking " + format_tool_call("shout", {"text": "hi"}) + "<tool_call>{bad</tool_call>"
    )
    r1 = await env.step(turn)
    assert not (r1.terminated or r1.truncated) and r1.reward == 0.0
    assert [m["content"] for m in r1.observations] == ["HI", r1.info.malformed[0].observation()]
    assert r1.observations[0]["tool_call_id"] == "call_0" and r1.observations[0]["name"] == "shout"
    assert r1.info.tool_results[0].output == "HI" and len(r1.info.malformed) == 1

    r2 = await env.step(parse_completion("HI"))
    assert r2.terminated and r2.reward == 1.0 and r2.observations == []
    assert r2.info.reward == Reward(value=1.0, components={"ok": 1.0}, detail="compared")


async def test_tool_failure_is_an_observation_and_max_turns_truncates() -> None:
    env = EchoEnv(max_turns=2)
    await env.reset(TASK)
    call = parse_completion(format_tool_call("shout", {"text": "fail"}))
    r1 = await env.step(call)
    assert r1.observations[0]["content"] == "error: shout failed: RuntimeError: cannot shout that"
    assert r1.info.tool_results[0].error == "exception" and not r1.truncated
    r2 = await env.step(call)
    assert r2.truncated and not r2.terminated


async def test_step_before_reset_is_an_env_error() -> None:
    with pytest.raises(EnvError, match="before reset"):
        await EchoEnv().step(parse_completion("x"))


class BrokenEnv(EchoEnv):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def initial_messages(self, task: Task) -> list[Message]:
        if self.where == "reset":
            raise KeyError("no_such_field")
        return super().initial_messages(task)

    async def score(self, answer: str) -> Reward:
        if self.where == "score":
            return 1 / 0  # type: ignore[return-value]
        return await super().score(answer)

    async def group_reward(self, outcomes: list[EpisodeOutcome]) -> list[float] | None:
        if self.where == "group":
            raise ValueError("bad group")
        return [1.0]


@pytest.mark.parametrize(
    ("where", "method", "kind"),
    [("reset", "initial_messages", "KeyError"), ("score", "score", "ZeroDivisionError")],
)
async def test_user_code_errors_become_env_errors_with_traceback(
    where: str, method: str, kind: str
) -> None:
    env = BrokenEnv(where)
    with pytest.raises(EnvError) as info:
        await env.reset(TASK)
        await env.step(parse_completion("HI"))
    err = info.value
    assert isinstance(err, EnvCodeError) and err.method == method and kind in str(err)
    assert err.env_id == "BrokenEnv" and "test_env.py" in err.traceback and kind in err.traceback


async def test_group_reward_hook() -> None:
    outcomes = [
        EpisodeOutcome(task_id="t0", reward=1.0, terminated=True, truncated=False, turns=t)
        for t in (3, 2)
    ] + [EpisodeOutcome(task_id="t0", reward=0.0, terminated=False, truncated=True, turns=4)]
    assert await apply_group_reward(EchoEnv(), outcomes) == [1.0, 1.5, 0.0]
    with pytest.raises(EnvCodeError, match="bad group"):
        await apply_group_reward(BrokenEnv("group"), outcomes)
    with pytest.raises(EnvError, match="returned 1 rewards for 3 episodes"):
        await apply_group_reward(BrokenEnv("none"), outcomes)


async def test_env_with_sandbox_tool_requires_a_sandbox() -> None:
    @tool
    async def ls(sandbox: object) -> str:
        """List files."""
        return "a.txt"

    class SandboxedEnv(EchoEnv):
        tools = (shout, ls)

    env = SandboxedEnv()
    assert env.needs_sandbox
    with pytest.raises(EnvError, match="needs a sandbox"):
        await env.reset(TASK)
    await env.reset(TASK, sandbox="sb")
    r = await env.step(parse_completion(format_tool_call("ls", {})))
    assert r.observations[0]["content"] == "a.txt"


class ProbeEnv(EchoEnv):
    @tool
    def probe(self, x: int) -> str:
        """Probe the base way.

        Args:
            x: What to probe.
        """
        return f"base {x}"

    @tool
    def other(self) -> str:
        """Another tool."""
        return "other"


async def test_a_subclass_redefines_or_removes_an_inherited_tool() -> None:
    class Redefined(ProbeEnv):
        @tool
        def probe(self, x: int, loud: bool = False) -> str:
            """Probe the subclass way.

            Args:
                x: What to probe.
                loud: Shout the answer.
            """
            return f"sub {x}" + ("!" if loud else "")

    env = Redefined()
    assert list(env.toolset) == ["shout", "probe", "other"]  # in place, not appended
    assert env.toolset["probe"].description == "Probe the subclass way."
    assert "loud" in env.tool_schemas()[1]["function"]["parameters"]["properties"]
    await env.reset(TASK)
    r = await env.step(parse_completion(format_tool_call("probe", {"x": 3, "loud": True})))
    assert r.observations[0]["content"] == "sub 3!"

    class Removed(ProbeEnv):
        probe = None  # type: ignore[assignment]

    assert list(Removed().toolset) == ["shout", "other"]
    assert list(ProbeEnv().toolset) == ["shout", "probe", "other"]


def test_duplicate_tool_names_are_an_env_error() -> None:
    class Dup(EchoEnv):
        tools = (shout, shout.__class__(shout.fn, name="shout"))

    with pytest.raises(EnvError, match="two tools are named 'shout'"):
        Dup().tool_schemas()

    class TwoAttributes(ProbeEnv):  # different attributes, one tool name: still an error
        @tool(name="probe")
        def probe_again(self, x: int) -> str:
            """Probe twice.

            Args:
                x: What to probe.
            """
            return ""

    with pytest.raises(EnvError, match="two tools are named 'probe'"):
        TwoAttributes().tool_schemas()


async def test_step_after_the_end_and_missing_hooks_are_env_errors() -> None:
    env = EchoEnv(max_turns=1)
    await env.reset(TASK)
    assert (await env.step(parse_completion(format_tool_call("shout", {"text": "a"})))).truncated
    with pytest.raises(EnvError, match="after the episode ended"):
        await env.step(parse_completion("HI"))
    await env.reset(TASK)
    assert (await env.step(parse_completion("HI"))).terminated

    class NoScore(Env):
        def initial_messages(self, task: Task) -> list[Message]:
            return [user("q")]

    bare = NoScore()
    await bare.reset(TASK)
    with pytest.raises(EnvCodeError, match="must implement score") as e:
        await bare.step(parse_completion("x"))
    assert e.value.method == "score" and not NoScore.has_demonstration()
    assert EchoEnv.has_demonstration() is False
