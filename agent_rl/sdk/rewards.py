"""Rewards: rules over the final answer, verifiers run in the sandbox, and group hooks.

An episode's reward is a `Reward` (a value plus named components for inspection). It comes
from one of two places an environment chooses in `Env.score`:
- a rule over the answer text (`exact_match`, `token_f1`, `number_match` below);
- a verifier: a Python program run in the episode's sandbox (`verify_in_sandbox`, or
  `run_json_program` to bring results back and judge them on the host), e.g. hidden unit
  tests, so untrusted model code never runs on the host.

After a whole group of episodes on one task has finished, the scheduler calls the
environment's group hook (`Env.group_reward`) with every `EpisodeOutcome`; it returns one
reward per episode (e.g. a bonus for the shortest correct answer), or None to keep them.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from agent_rl.kernel.errors import EnvError, ToolError

if TYPE_CHECKING:
    from agent_rl.sdk.sandbox import Sandbox


class Reward(BaseModel):
    """The score of one episode."""

    value: float
    components: dict[str, float] = Field(default_factory=dict)
    """Named parts (e.g. em, f1, tests_passed) kept for inspection, not summed again."""
    detail: str = ""
    """Why, in words (e.g. which test failed); never shown to the model."""


class EpisodeOutcome(BaseModel):
    """What a group reward hook sees of one finished episode."""

    episode_id: str | None = None
    task_id: str
    reward: float
    terminated: bool
    truncated: bool
    turns: int
    answer: str = ""
    """Content of the final assistant turn."""
    completion_tokens: int = 0


# ---------------------------------------------------------------------------- answer rules

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and articles, squeeze whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(text: str) -> str:
    """The answer inside `<answer>...</answer>` if present, else the whole text, stripped."""
    m = re.search(r"<answer>(.*?)</answer>", text, flags=re.S)
    return (m.group(1) if m else text).strip()


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Best SQuAD token F1 of the prediction against any gold answer."""
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        ref = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            p, r = common / len(pred), common / len(ref)
            best = max(best, 2 * p * r / (p + r))
    return best


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def number_match(prediction: str, gold: str | int | float) -> float:
    """1.0 if the last number in the prediction equals the gold number exactly."""
    got = last_number(prediction)
    if got is None:
        return 0.0
    try:
        # Decimal, not float: 420196140727489673 and ...674 are the same float.
        return float(Decimal(got) == Decimal(str(gold)))
    except InvalidOperation:
        return 0.0


def number_reward(answer: str, gold: str | int | float) -> Reward:
    """`number_match` as a Reward with its one component, `correct`."""
    correct = number_match(answer, gold)
    return Reward(value=correct, components={"correct": correct})


# ---------------------------------------------------------------------------- verifiers


class SandboxRun(BaseModel):
    """What a program run in the sandbox reported: its last stdout line as JSON, or why not."""

    value: Any = None
    ok: bool
    """The program finished and its last stdout line was JSON."""
    detail: str = ""


async def run_json_program(
    sandbox: Sandbox,
    program: str | Sequence[str],
    *,
    files: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> SandboxRun:
    """Restart the sandbox, run `program` (Python source, or an argv) as its verifier
    (`Sandbox.run_verifier`: the verifier's own uid, `files` written by it, readable by it
    alone), and parse the last line it printed as JSON.

    The restart (`Sandbox.restart`) kills every process the model's calls started, as a whole,
    before anything is written: nothing of the model's runs while the files are written and the
    program starts, and nothing of the model's can reach the program later (the model's code it
    runs with `run_as_tool` included). Whatever the model's code can cause, a file it left in
    the way, a timeout, a death without a result line, a sandbox out of processes or memory, is
    `ok=False` with the reason: a scored 0, never a failed episode. Only a sandbox that cannot
    be started again (the host's failure) raises `SandboxError`."""
    await sandbox.restart()
    try:
        res = await sandbox.run_verifier(
            program if isinstance(program, str) else list(program), files=files, timeout=timeout
        )
    except ToolError as e:  # a path or text that cannot be encoded: the caller's files
        return SandboxRun(ok=False, detail=f"the sandbox refused the verifier's files: {e}")
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    if lines and not res.timed_out and not res.restarted:
        try:
            return SandboxRun(value=json.loads(lines[-1]), ok=True)
        except ValueError:
            pass
    if res.timed_out:
        why = "timed out"
    elif res.restarted:
        why = "could not run"
    else:
        why = f"exit code {res.exit_code}, no JSON result line"
    tail = (res.stderr or res.stdout)[-500:]
    return SandboxRun(ok=False, detail=f"{why}: {tail}".strip())


async def verify_in_sandbox(
    sandbox: Sandbox,
    program: str | Sequence[str],
    *,
    files: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Reward:
    """Run a verifier (Python source, or an argv) whose last stdout line is a JSON `Reward`; 0,
    with the reason in `detail`, if it gave none.

    It runs as `run_json_program` runs it: in the sandbox restarted, under the verifier's own
    uid, on files it wrote after the restart, and no answer but the worker's is accepted (a
    forged one raises SandboxError). What this returns is what the program printed. That is as
    trustworthy as the program and what it reads: files the model left in the work dir are the
    model's, and a verifier that runs the model's code must do it with `run_as_tool` (a child
    under tool code's uid, whose output it judges), not in its own process, and read its inputs
    before. None of this holds on the rlimit backend.
    """
    run = await run_json_program(sandbox, program, files=files, timeout=timeout)
    if run.ok:
        try:
            return Reward.model_validate(run.value)
        except ValueError as e:
            return Reward(value=0.0, detail=f"verifier printed something that is not a Reward: {e}")
    return Reward(value=0.0, detail=f"verifier {run.detail}")


def as_reward(value: Reward | float | int | bool | Mapping[str, Any]) -> Reward:
    """Accept what a user's `score` returns: a Reward, a number, or a dict shaped like one."""
    if isinstance(value, Reward):
        return value
    if isinstance(value, (int, float)):
        return Reward(value=float(value))
    if isinstance(value, Mapping):
        return Reward.model_validate(dict(value))
    raise EnvError(f"score() returned {type(value).__name__}: return a float or a Reward")
