"""`code-tests`: write a Python function; reward = fraction of hidden unit tests passed.

The prompt names the function, describes it and shows one example; the model may try code with
the sandboxed `python` tool, and ends with the function in a ```python block (the last block
of the final message is graded; with no block, the whole message is).

Grading keeps the model's code off the host *and* away from the verdict: the sandbox only runs
the solution on each test's arguments (each call under a SIGALRM deadline, its prints
swallowed) and reports the return values as JSON; the expected values never enter the sandbox,
and the comparison happens here. A solution that loops forever, crashes the interpreter, or
prints a fake result line gains nothing.

Tasks: `problems.jsonl` beside this file (20 problems, each with a reference solution used by
the demonstration policy). `tasks=FILE.jsonl` with the same fields replaces it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent_rl.sdk.env import Env
from agent_rl.sdk.messages import Message, user
from agent_rl.sdk.rewards import Reward, run_json_program
from agent_rl.sdk.sandbox import Limits, SandboxSpec
from agent_rl.sdk.sandbox_tools import python_repl
from agent_rl.sdk.tasks import JsonlTasks, Task, TaskSource
from agent_rl.sdk.tool_calls import format_tool_call

PROBLEMS = Path(__file__).with_name("problems.jsonl")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)

# Runs inside the sandbox. Reads solution.py and tests_input.json, prints one JSON line.
RUNNER = r"""
import contextlib, io, json, signal, sys

def _deadline(signum, frame):
    raise TimeoutError("took too long")

def emit(obj):
    sys.__stdout__.write("\n" + json.dumps(obj) + "\n")
    sys.__stdout__.flush()

signal.signal(signal.SIGALRM, _deadline)
spec = json.load(open("tests_input.json"))
limit = spec["timeout_s"]
ns = {"__name__": "solution"}
try:
    with contextlib.redirect_stdout(io.StringIO()):
        signal.alarm(limit)
        exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
        signal.alarm(0)
    fn = ns[spec["function"]]
except BaseException as e:
    signal.alarm(0)
    emit({"load_error": f"{type(e).__name__}: {e}"[:300]})
    raise SystemExit(0)
outputs = []
for args in spec["args"]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            signal.alarm(limit)
            result = fn(*args)
            signal.alarm(0)
        outputs.append({"ok": json.loads(json.dumps(result))})
    except BaseException as e:
        signal.alarm(0)
        outputs.append({"error": f"{type(e).__name__}: {e}"[:300]})
emit({"outputs": outputs})
"""


def extract_code(answer: str) -> str:
    blocks = _CODE_BLOCK.findall(answer)
    return blocks[-1] if blocks else answer


class CodeTestsEnv(Env):
    """Write a Python function; hidden unit tests run in the sandbox; reward = fraction passed."""

    tools = (python_repl,)
    uses_sandbox = True
    sandbox_spec = SandboxSpec(limits=Limits(wall_s=20.0, cpu_s=20, memory_mb=256, disk_mb=64, tmp_mb=32))

    def __init__(
        self, *, per_test_timeout_s: int = 2, max_turns: int | None = 6, **kwargs: Any
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        self.per_test_timeout_s = per_test_timeout_s

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        # 20 problems are too few to hold some out; train and eval are the same set.
        return JsonlTasks(PROBLEMS)

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(task["prompt"])]

    async def score(self, answer: str) -> Reward:
        assert self.task is not None and self.sandbox is not None
        tests = self.task["tests"]
        spec = {"function": self.task["function"], "args": [t["args"] for t in tests],
                "timeout_s": self.per_test_timeout_s}  # fmt: skip
        files = {"solution.py": extract_code(answer), "tests_input.json": json.dumps(spec)}
        run = await run_json_program(self.sandbox, RUNNER, files=files)
        total = len(tests)
        result = run.value if run.ok and isinstance(run.value, dict) else {}
        outputs = result.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != total:
            why = result.get("load_error") or run.detail or "the runner reported no outputs"
            return Reward(
                value=0.0, components={"passed": 0.0, "total": float(total)}, detail=str(why)
            )
        failures = []
        for test, out in zip(tests, outputs, strict=False):
            if not (isinstance(out, dict) and "ok" in out and out["ok"] == test["expected"]):
                got = out.get("error", out.get("ok")) if isinstance(out, dict) else out
                call = f"{self.task['function']}(*{test['args']!r})"
                failures.append(f"{call} gave {got!r}, expected {test['expected']!r}")
        passed = total - len(failures)
        detail = failures[0] if failures else ""
        return Reward(
            value=passed / total,
            components={"passed": float(passed), "total": float(total)},
            detail=detail,
        )

    async def demonstrate(self, messages: list[Message]) -> str:
        # Try the reference solution on the prompt's example in the sandbox, then submit it.
        assert self.task is not None
        solution, example = self.task["solution"], self.task["tests"][0]
        if messages[-1]["role"] != "tool":
            args = ", ".join(repr(a) for a in example["args"])
            call = f"{solution}\nprint(json.dumps({self.task['function']}({args})))"
            return format_tool_call("python", {"code": "import json\n" + call})
        return f"```python\n{solution}```"
