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

# The judge: runs inside the sandbox under the verifier's identity (`Sandbox.run_verifier`),
# reads its hidden inputs (which tool code cannot read) before any of the model's code runs, and
# runs the solution in a child under tool code's ids (`run_as_tool`), which can neither reach the
# judge nor write its stdout. The child answers one JSON line per test; the judge prints them.
RUNNER = r"""
import json
spec = json.load(open("tests_input.json"))
request = {"solution": open("solution.py").read(), "function": spec["function"],
           "args": spec["args"], "timeout_s": spec["timeout_s"]}
n = len(spec["args"])
run = run_as_tool(CHILD, stdin=json.dumps(request).encode(),
                  timeout=min(spec["timeout_s"] * (n + 1) + 1, spec["budget_s"]))
answers = []
for line in run["stdout"].decode("utf-8", "replace").splitlines():
    try:
        got = json.loads(line)
    except ValueError:
        continue
    if isinstance(got, dict) and len(got) == 1 and set(got) <= {"ok", "error", "load_error"}:
        answers.append(got)
if answers and "load_error" in answers[0]:
    print(json.dumps({"load_error": str(answers[0]["load_error"])[:300]}))
    raise SystemExit(0)
answers = [a for a in answers if "load_error" not in a][:n]
why = "timed out" if run["timed_out"] else f"exit code {run['exit_code']}"
answers += [{"error": f"no answer: the solution's process ended ({why})"}] * (n - len(answers))
print(json.dumps({"outputs": answers}))
"""

# The child: tool code's ids, the model's solution loaded in it. Its prints are swallowed; what
# it writes to its stdout is taken as its functions' return values, nothing more.
CHILD = r"""
import contextlib, io, json, os, signal, sys

def _deadline(signum, frame):
    raise TimeoutError("took too long")

req = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")

def answer(obj):
    out.write(json.dumps(obj) + "\n")
    out.flush()

signal.signal(signal.SIGALRM, _deadline)
limit = req["timeout_s"]
ns = {"__name__": "solution"}
try:
    with contextlib.redirect_stdout(io.StringIO()):
        signal.alarm(limit)
        exec(compile(req["solution"], "solution.py", "exec"), ns)
        signal.alarm(0)
    fn = ns[req["function"]]
except BaseException as e:
    signal.alarm(0)
    answer({"load_error": f"{type(e).__name__}: {e}"[:300]})
    raise SystemExit(0)
for args in req["args"]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            signal.alarm(limit)
            result = fn(*args)
            signal.alarm(0)
        answer({"ok": json.loads(json.dumps(result))})
    except BaseException as e:
        signal.alarm(0)
        answer({"error": f"{type(e).__name__}: {e}"[:300]})
"""


def extract_code(answer: str) -> str:
    blocks = _CODE_BLOCK.findall(answer)
    return blocks[-1] if blocks else answer


class CodeTestsEnv(Env):
    """Write a Python function; hidden unit tests run in the sandbox; reward = fraction passed."""

    tools = (python_repl,)
    uses_sandbox = True
    sandbox_spec = SandboxSpec(
        limits=Limits(wall_s=20.0, cpu_s=20, memory_mb=256, disk_mb=64, tmp_mb=32)
    )

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
        budget = max(1.0, self.sandbox.spec.limits.wall_s - 2)
        spec = {"function": self.task["function"], "args": [t["args"] for t in tests],
                "timeout_s": self.per_test_timeout_s, "budget_s": budget}  # fmt: skip
        files = {"solution.py": extract_code(answer), "tests_input.json": json.dumps(spec)}
        run = await run_json_program(self.sandbox, f"CHILD = {CHILD!r}\n{RUNNER}", files=files)
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
