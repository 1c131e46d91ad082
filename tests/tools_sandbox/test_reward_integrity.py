"""The abuse suite, part three: nothing the policy's tool code does changes or dodges a verdict.

On bubblewrap and Docker (the rlimit backend claims none of this). Tool code leaves survivors
behind by every means we know (a zombie leader whose threads live on, a setsid daemon, a thread
of the REPL, a survivor that wakes the stopped REPL with SIGCONT); they rewrite the verifier's
inputs and append a forged result to its stdout through /proc. Others exhaust the sandbox's
pids, memory and tmpfs before scoring or during a call, write a partial frame to the REPL's
socket, or renice the worker. Each test asserts the verifier's result is what the honest
verifier computes (or a scored 0 with its reason), that no call of the policy's ends as an
exception (an episode `failed` is never trained on: a way to dodge a 0), and, for the survivors,
that they are gone once the verifier has run.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from agent_rl import make
from agent_rl.config import SandboxLimits
from agent_rl.kernel.errors import ToolError
from agent_rl.sdk.env import Env
from agent_rl.sdk.rewards import verify_in_sandbox
from agent_rl.sdk.sandbox import Sandbox, SandboxBackend, SandboxSpec
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from tools_sandbox.cgroups import process_cgroup

from .conftest import backend_or_skip, small_limits
from .helpers import worker_pid

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(limits=small_limits(wall_s=3.0, cpu_s=3))
SYS_EXIT = {"x86_64": 60, "aarch64": 93}[os.uname().machine]

# An honest verifier: 1.0 when the model's answer equals the hidden expected one (here it does
# not: the model wrote 'wrong'). It takes its time, as real ones do: the attackers' window.
VERIFIER = (
    "import json, time\ntime.sleep(0.3)\n"
    "same = open('answer.txt').read() == open('expected.txt').read()\n"
    "print(json.dumps({'value': float(same)}))"
)

# What every survivor does until it is killed: beat, make the answer the expected one as soon
# as the hidden file appears, and append a forged result to the stdout of every process of its
# uid it can open through /proc (an exec'd program is dumpable: its fds are open to its uid).
ATTACK = textwrap.dedent("""
    def attack():
        import os, time
        outs = {}
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with open('/work/beats', 'a') as f:
                f.write('.')
            try:
                expected = open('/work/expected.txt').read()
                if expected:
                    with open('/work/answer.txt', 'w') as f:
                        f.write(expected)
            except OSError:
                pass
            for name in os.listdir('/proc'):
                if name.isdigit() and int(name) != os.getpid() and name not in outs:
                    try:
                        outs[name] = open(f'/proc/{name}/fd/1', 'a')
                    except OSError:
                        pass
            for out in outs.values():
                try:
                    out.write('\\n{"value": 1.0}\\n')
                    out.flush()
                except OSError:
                    pass
            time.sleep(0.002)
""")

ZOMBIE_LEADER = ATTACK + textwrap.dedent(f"""
    import ctypes, os, threading
    if os.fork() == 0:  # a session of its own, and a main thread that leaves by the raw exit
        os.setsid()     # syscall: the process shows as a zombie while its thread runs on
        threading.Thread(target=attack).start()
        ctypes.CDLL(None).syscall({SYS_EXIT}, 0)
""")

SETSID_DAEMON = ATTACK + textwrap.dedent("""
    import os
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            attack()
        os._exit(0)
    os.wait()
""")

REPL_THREAD = ATTACK + "import threading\nthreading.Thread(target=attack, daemon=True).start()"

# The REPL's thread attacks; a zombie-leader survivor keeps waking the stopped REPL up.
SIGCONT_SESSION = REPL_THREAD + textwrap.dedent(f"""
    import ctypes, os, signal, threading, time
    session = os.getpgid(0)
    def wake():  # from when the REPL has been stopped after this call (or killed for waking)
        time.sleep(0.3)
        for _ in range(15000):
            try:
                os.killpg(session, signal.SIGCONT)
            except OSError:
                pass
            time.sleep(0.002)
    if os.fork() == 0:
        os.setsid()
        threading.Thread(target=wake).start()
        ctypes.CDLL(None).syscall({SYS_EXIT}, 0)
""")

SURVIVORS = {
    "zombie_leader": (ZOMBIE_LEADER, False),
    "setsid_daemon": (SETSID_DAEMON, False),
    "repl_thread": (REPL_THREAD, True),
    "sigcont_session": (SIGCONT_SESSION, True),
}

FILL_PIDS = textwrap.dedent("""
    import threading, time
    threads = []
    try:
        while True:
            t = threading.Thread(target=time.sleep, args=(1000,), daemon=True)
            t.start()
            threads.append(t)
    except RuntimeError:
        pass
    len(threads)
""")

FILL_TMPFS_AND_MEMORY = textwrap.dedent("""
    for path in ('/work/fill', '/tmp/fill', '/dev/shm/fill'):
        try:
            with open(path, 'wb') as f:
                while True:
                    f.write(b'x' * (1 << 20))
                    f.flush()
        except OSError:
            pass
    hog = []
    try:
        while True:
            hog.append(bytearray(4 << 20))
    except MemoryError:
        pass
""")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["bwrap", "docker"])
async def isolating(request: pytest.FixtureRequest) -> AsyncIterator[SandboxBackend]:
    """The backends that isolate (every attack here is in scope of bwrap's and Docker's), one
    per module: each test makes its own sandboxes."""
    b = backend_or_skip(request.param)
    try:
        yield b
    finally:
        await b.aclose()
        assert b.live() == 0


async def beats(sb: Sandbox) -> int:
    """How often the survivors have beaten so far."""
    try:
        return len(await sb.read_file("beats"))
    except ToolError:  # none yet
        return 0


@pytest.mark.parametrize("means", [*SURVIVORS, "zombie_leader_exec_verifier"])
async def test_survivors_cannot_touch_the_verifier(isolating: SandboxBackend, means: str) -> None:
    """The verifier's inputs and stdout are out of reach of whatever tool code left running; the
    survivors are dead once the verifier has run, whatever means kept them alive."""
    code, persistent = SURVIVORS[means.removesuffix("_exec_verifier")]
    async with await isolating.create(SPEC) as sb:
        await sb.write_file("answer.txt", "wrong")
        r = await sb.run_python(code, persistent=persistent)
        assert not r.timed_out and not r.restarted, r
        await anyio.sleep(0.1)
        program = ["python3", "-c", VERIFIER] if means.endswith("exec_verifier") else VERIFIER
        reward = await verify_in_sandbox(sb, program, files={"expected.txt": "right"})
        assert reward.value == 0.0, reward
        after = await beats(sb)
        await anyio.sleep(0.2)
        assert await beats(sb) == after, "a survivor outlived the verification"


async def test_a_restart_kills_tool_code_and_keeps_only_what_it_may(
    isolating: SandboxBackend,
) -> None:
    """A restart freezes the sandbox's cgroup and kills tool code's processes (the REPL, its
    threads and the pids they hold): the worker and /work stay (where this host can freeze the
    cgroup, as here and in CI; elsewhere the sandbox is started afresh). Nothing of tool code's
    beats after it, and the next call works."""
    async with await isolating.create(SPEC) as sb:
        assert (await sb.run_python(REPL_THREAD, persistent=True)).ok
        assert (await sb.run_python(FILL_PIDS, persistent=True)).ok
        worker = worker_pid(sb)
        await sb.restart()
        assert (worker_pid(sb) == worker) == (process_cgroup(worker) is not None)
        after = await beats(sb)
        assert after > 0  # /work kept
        r = await sb.run_python("import time\ntime.sleep(0.2)\nprint('next')")
        assert r.ok and r.stdout == "next\n", r
        assert await beats(sb) == after, "a survivor outlived the restart"


async def test_exhausted_pids_before_scoring_are_scored(isolating: SandboxBackend) -> None:
    """Threads of the REPL fill the pids limit, so the worker can start no verifier: the verifier
    runs anyway (in the restarted sandbox), and says what the honest one says."""
    async with await isolating.create(SPEC) as sb:
        await sb.write_file("answer.txt", "right")
        r = await sb.run_python(FILL_PIDS, persistent=True)
        assert r.ok and int(r.value or 0) > 10, r
        reward = await verify_in_sandbox(sb, VERIFIER, files={"expected.txt": "right"})
        assert reward.value == 1.0, reward


async def test_exhausted_pids_during_a_call_are_a_result(isolating: SandboxBackend) -> None:
    """The call after the REPL filled the pids limit cannot fork: a result saying so (the
    sandbox restarted), not an exception; the call after it works."""
    async with await isolating.create(SPEC) as sb:
        assert (await sb.run_python(FILL_PIDS, persistent=True)).ok
        r = await sb.run_python("print('hello')")
        assert r.restarted and r.exit_code is None and "resources" in r.stderr, r
        r = await sb.run_python("print('hello')")
        assert r.ok and r.stdout == "hello\n", r


async def test_full_tmpfs_and_memory_before_scoring_are_scored(isolating: SandboxBackend) -> None:
    """/work, /tmp and /dev/shm full and the REPL holding all the memory it can get: the verdict
    is a scored 0 with its reason (the verifier's file does not fit in /work), no failure; with
    /work emptied again, the honest verdict."""
    async with await isolating.create(SPEC) as sb:
        await sb.write_file("answer.txt", "right")
        await sb.run_python(FILL_TMPFS_AND_MEMORY, persistent=True)
        reward = await verify_in_sandbox(sb, VERIFIER, files={"expected.txt": "right"})
        assert reward.value == 0.0 and "expected.txt" in reward.detail, reward
        await sb.run_python(FILL_TMPFS_AND_MEMORY, persistent=True)
        assert (await sb.run_python("import os\nos.remove('/work/fill')")).ok
        reward = await verify_in_sandbox(sb, VERIFIER, files={"expected.txt": "right"})
        assert reward.value == 1.0, reward


async def test_a_partial_frame_does_not_hold_the_worker(isolating: SandboxBackend) -> None:
    """The REPL writes the start of a frame to its socket and sleeps: the call ends at its own
    deadline, not the host's grace period later, and without a restart."""
    code = textwrap.dedent("""
        import os, socket, struct, time
        for fd in range(3, 64):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            if s.family == socket.AF_UNIX:
                s.send(struct.pack('>I', 1000) + b'{')
        time.sleep(30)
    """)
    async with await isolating.create(SPEC) as sb:
        t = time.monotonic()
        r = await sb.run_python(code, persistent=True, timeout=1.0)
        assert time.monotonic() - t < 4.0 and not r.restarted and not r.ok, r  # (was 6 s+)
        r = await sb.run_python("print('next')", persistent=True)
        assert r.ok and r.stdout == "next\n", r


async def test_the_worker_keeps_its_scheduling(isolating: SandboxBackend) -> None:
    """Tool code may renice the worker (its effective uid is tool code's), move it to one CPU
    and make it SCHED_IDLE: before the next request the worker has its own back."""
    code = textwrap.dedent("""
        import os
        w = os.getppid()
        os.setpriority(os.PRIO_PROCESS, w, 19)
        os.sched_setaffinity(w, {0})
        os.sched_setscheduler(w, os.SCHED_IDLE, os.sched_param(0))
        print(os.getpriority(os.PRIO_PROCESS, w), os.sched_getscheduler(w))
    """)
    async with await isolating.create(SPEC) as sb:
        pid = worker_pid(sb)
        cpus = os.sched_getaffinity(pid)
        r = await sb.run_python(code)
        assert r.ok and r.stdout == f"19 {os.SCHED_IDLE}\n", r  # the attack took
        assert (await sb.run_python("1")).ok
        assert os.getpriority(os.PRIO_PROCESS, pid) == 0
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.sched_getaffinity(pid) == cpus


def test_limits_whose_tmpfs_can_fill_the_memory_are_refused() -> None:
    with pytest.raises(ValueError, match=r"disk_mb \(256\).*tmp_mb \(64.*memory_mb \(256\)"):
        SandboxLimits(memory_mb=256)
    SandboxLimits(memory_mb=256, disk_mb=64, tmp_mb=32)  # 128 MiB of tmpfs leave room


# A zombie-leader survivor that attacks and holds every pid it can get.
ZOMBIE_HOG = ATTACK + textwrap.dedent(f"""
    import ctypes, os, threading, time
    def hog():  # every pid that is free, at once
        while True:
            try:
                threading.Thread(target=time.sleep, args=(1000,)).start()
            except RuntimeError:
                time.sleep(0.001)
    if os.fork() == 0:
        os.setsid()
        threading.Thread(target=attack).start()
        threading.Thread(target=hog).start()
        ctypes.CDLL(None).syscall({SYS_EXIT}, 0)
""")


@pytest.mark.parametrize("env_id", ["code-tests", "python-math"])
async def test_an_attacking_episode_ends_with_the_honest_reward(
    isolating: SandboxBackend, env_id: str
) -> None:
    """An episode whose tool code leaves a survivor that rewrites the verifier's files (code-tests
    grades solution.py; the survivor puts the reference solution there) and holds every free pid,
    kills its REPL (the next call needs a new one) and answers wrong: every step is a result, and
    the reward is the honest one (0)."""
    env = make(env_id)
    task = next(iter(env.task_source().take(1)))
    assert env.sandbox_spec is not None
    async with await isolating.create(env.sandbox_spec) as sb:
        await env.reset(task, sandbox=sb)
        attack = ZOMBIE_HOG
        if env_id == "code-tests":  # make the hidden-test runner read the right solution
            attack = attack.replace(
                "open('/work/expected.txt').read()",
                f"open('/work/tests_input.json') and {task['solution']!r}",
            )
            attack = attack.replace("/work/answer.txt", "/work/solution.py")
        for code in (attack, "import os\nos.kill(os.getpid(), 9)", "print(1)"):
            call = format_tool_call("python", {"code": code, "timeout": 2})
            step = await env.step(parse_completion(call))
            assert not step.terminated
        wrong = (
            "```python\ndef nothing():\n    return None\n```" if env_id == "code-tests" else "-1"
        )
        step = await env.step(parse_completion(wrong))
        assert step.terminated and step.reward == 0.0, step.info.reward
        await env.close()


# ---------------------------------------------------------------- the verifier's own identity
#
# Verifiers that run the policy's code: code-tests' hidden tests run the model's solution, and a
# generic verifier runs the model's program. The verifier runs under the worker's uid, the
# policy's code in a child under tool code's (`Sandbox.run_verifier`, `run_as_tool`): whatever
# that code does, the verdict is the honest verifier's.

FORGERS = {
    # a result line in the format the host parses, in place of what the grader prints
    "forged_result_line": "import json\n_dumps = json.dumps\n"
    "json.dumps = lambda o, *a, **k: FORGED if isinstance(o, dict) and 'outputs' in o "
    "else _dumps(o, *a, **k)\n",
    # the same line, then an exit before anything else can be printed
    "exit_after_printing": "import os, sys\n"
    "sys.__stdout__.write('\\n' + FORGED + '\\n')\nsys.__stdout__.flush()\nos._exit(0)\n",
    # a detached writer appends the line to every stdout it can open through /proc (and to the
    # one it inherited, if INHERITED), for 1.5 s: after whatever the verifier prints last
    "proc_stdout": textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            end, outs = time.monotonic() + 1.5, {}
            if INHERITED:
                outs['self'] = os.dup(1)
            null = os.open('/dev/null', os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            while time.monotonic() < end:
                for name in os.listdir('/proc'):
                    if name.isdigit() and int(name) != os.getpid() and name not in outs:
                        try:
                            outs[name] = os.open(f'/proc/{name}/fd/1', os.O_WRONLY | os.O_APPEND)
                        except OSError:
                            pass
                for fd in outs.values():
                    try:
                        os.write(fd, ('\\n' + FORGED + '\\n').encode())
                    except OSError:
                        pass
                time.sleep(0.002)
            os._exit(0)
    """),
    # the hidden inputs and the solution rewritten (the tests emptied, the reference solution)
    "rewrite_hidden_tests": textwrap.dedent("""
        import json
        for name, text in (('tests_input.json', json.dumps({'function': FUNCTION, 'args': [],
                                                           'timeout_s': 1, 'budget_s': 1})),
                           ('solution.py', SOLUTION)):
            try:
                with open(name, 'w') as f:
                    f.write(text)
            except OSError:
                pass
    """),
}


@pytest.fixture(scope="module")
async def graded(isolating: SandboxBackend) -> AsyncIterator[tuple[Env, Task]]:
    """code-tests on its first problem, in one sandbox for every attack (each verification
    restarts it)."""
    env = make("code-tests")
    task = next(iter(env.task_source().take(1)))
    assert env.sandbox_spec is not None
    async with await isolating.create(env.sandbox_spec) as sb:
        await env.reset(task, sandbox=sb)
        yield env, task


@pytest.mark.parametrize("attack", sorted(FORGERS))
async def test_a_solution_cannot_forge_its_grade(graded: tuple[Env, Task], attack: str) -> None:
    """A wrong solution that forges code-tests' result line (in the grader's own process, before
    an early exit, through /proc and its inherited stdout, by rewriting the hidden tests) gets
    the honest grade, 0. (Before the grader had its own identity, the first three got 1.0.)"""
    env, task = graded
    forged = json.dumps({"outputs": [{"ok": t["expected"]} for t in task["tests"]]})
    solution = (
        f"FORGED = {forged!r}\nFUNCTION = {task['function']!r}\nSOLUTION = {task['solution']!r}\n"
        "INHERITED = True\n"
        f"{FORGERS[attack]}\ndef {task['function']}(*args):\n    return None\n"
    )
    reward = await env.score(f"```python\n{solution}```")
    assert reward.value == 0.0, reward
    assert reward.components["total"] == len(task["tests"]), reward


async def test_a_solution_cannot_kill_its_grader(graded: tuple[Env, Task]) -> None:
    """A right solution that SIGKILLs or SIGSTOPs every process it may (its runner included)
    gets the honest grade, 1.0."""
    env, task = graded
    attack = textwrap.dedent("""
        import os, signal
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for name in os.listdir('/proc'):
                if name.isdigit() and int(name) != os.getpid():
                    try:
                        os.kill(int(name), sig)
                    except OSError:
                        pass
    """)
    assert env.sandbox is not None  # (and a REPL the restart kills, whose fds the grader reuses)
    assert (await env.sandbox.run_python("x = 1", persistent=True)).ok
    reward = await env.score(f"```python\n{attack}\n{task['solution']}```")
    assert reward.value == 1.0, reward


# A verifier that runs the model's program (answer.py) and compares what it prints with the
# hidden expected.txt, read after the program ran. Where `run_as_tool` is not there (the code
# before the verifier had its own identity) it runs it as verifiers did then, as a subprocess.
RUNS_THE_MODEL = textwrap.dedent("""
    import json, subprocess, sys
    try:
        run_as_tool
    except NameError:
        def run_as_tool(program, stdin=b'', timeout=10.0):
            p = subprocess.run([sys.executable, '-c', program], input=stdin, timeout=timeout,
                               capture_output=True)
            return {'exit_code': p.returncode, 'stdout': p.stdout}
    run = run_as_tool(open('answer.py').read(), timeout=3)
    same = run['stdout'].decode().strip() == open('expected.txt').read()
    print(json.dumps({'value': float(same)}))
""")

MODEL_ATTACKS = {
    # honest verdict 0: the program prints what it cannot know
    "read_hidden": ("print(open('expected.txt').read())", 0.0),
    # the hidden file's content looked for in the program's memory (the request that carried
    # it, if the program were a fork of the worker)
    "memory_hidden": (
        textwrap.dedent("""
            import base64, gc
            for o in gc.get_objects():
                if isinstance(o, dict) and isinstance(o.get('files'), dict):
                    if 'expected.txt' in o['files']:
                        print(base64.b64decode(o['files']['expected.txt']).decode())
                        break
        """),
        0.0,
    ),
    "rewrite_hidden": ("open('expected.txt', 'w').write('forged')\nprint('forged')", 0.0),
    # honest verdict 1: the right answer, then every process it may signal killed
    "kill_verifier": (
        textwrap.dedent("""
            import os, signal, sys
            print('right')
            sys.stdout.flush()
            for name in os.listdir('/proc'):
                if name.isdigit() and int(name) != os.getpid():
                    try:
                        os.kill(int(name), signal.SIGKILL)
                    except OSError:
                        pass
        """),
        1.0,
    ),
}


@pytest.fixture(scope="module")
async def shared(isolating: SandboxBackend) -> AsyncIterator[Sandbox]:
    """One sandbox for every attack below (each verification restarts it)."""
    async with await isolating.create(SPEC) as sb:
        yield sb


@pytest.mark.parametrize("attack", sorted(MODEL_ATTACKS))
async def test_the_models_program_cannot_reach_its_verifier(shared: Sandbox, attack: str) -> None:
    """The model's program, run by the verifier, reads or rewrites the hidden file, or kills the
    verifier: the verdict is the honest one. (Before, each of these changed it.)"""
    code, honest = MODEL_ATTACKS[attack]
    await shared.write_file("answer.py", code)
    reward = await verify_in_sandbox(shared, RUNS_THE_MODEL, files={"expected.txt": "right"})
    assert reward.value == honest, reward


# An exec'd verifier drives the same runner through the socket in $AGENT_RL_TOOL_RUNNER: a
# frame (4-byte length, JSON {"code" or "argv", "timeout"}) with the program's stdin, stdout and
# stderr attached (SCM_RIGHTS); the answer is a frame {"status": exit status}.
EXEC_VERIFIER = textwrap.dedent("""
    import json, os, socket, struct
    sock = socket.socket(fileno=int(os.environ['AGENT_RL_TOOL_RUNNER']))
    i_r, i_w = os.pipe()
    o_r, o_w = os.pipe()
    req = json.dumps({'code': open('answer.py').read(), 'timeout': 3}).encode()
    socket.send_fds(sock, [struct.pack('>I', len(req)) + req], [i_r, o_w, o_w])
    for fd in (i_r, o_w, i_w):
        os.close(fd)
    out = b''
    while chunk := os.read(o_r, 65536):
        out += chunk
    same = out.decode().strip() == open('expected.txt').read()
    print(json.dumps({'value': float(same)}))
""")


@pytest.mark.parametrize("code", ["print('right')", MODEL_ATTACKS["read_hidden"][0]])
async def test_an_execd_verifier_runs_the_model_through_its_runner(
    shared: Sandbox, code: str
) -> None:
    """The runner's socket protocol, from an exec'd verifier: the model's program runs under
    tool code's uid (it cannot read the hidden file), and its output comes back."""
    await shared.write_file("answer.py", code)
    program = ["python3", "-c", EXEC_VERIFIER]
    reward = await verify_in_sandbox(shared, program, files={"expected.txt": "right"})
    assert reward.value == (1.0 if code == "print('right')" else 0.0), reward
