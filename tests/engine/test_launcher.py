"""The launcher: one-line start failures, stock flags on GPU, crash detection on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent_rl.engine.install import compat_dir, engine_env
from agent_rl.engine.launcher import EngineServer, _ephemeral_range, free_port
from agent_rl.kernel.errors import EngineError


def test_bad_model_dir(tmp_path: Path, engine_venv: Path) -> None:
    with pytest.raises(EngineError) as e:
        EngineServer(tmp_path / "missing", venv=engine_venv).start()
    assert "agent-rl model init" in str(e.value) and "\n" not in str(e.value)


def test_free_ports_are_never_ones_the_kernel_gives_to_connections() -> None:
    """An engine binds its port ~20 s after it was picked; a port from the ephemeral range could
    be taken by an outgoing connection meanwhile (seen in a loaded test run)."""
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert not [p for p in ports if low <= p <= high]
    assert len(set(ports)) > 150  # spread at random, not one port handed out again and again
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        assert ports[0] not in {free_port() for _ in range(300)}  # one in use is skipped


def test_port_taken(tiny_dense_model: Path, engine_venv: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} .* in use: choose another with --port"):
            EngineServer(tiny_dense_model, venv=engine_venv, port=port).start()


def test_missing_engine_environment(tiny_dense_model: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="run `agent-rl engine install`"):
        EngineServer(tiny_dense_model, venv=tmp_path / "no-venv").start()


def test_cpu_and_gpu_commands(tiny_moe_model: Path, tmp_path: Path) -> None:
    cpu = EngineServer(tiny_moe_model, venv=tmp_path, device="cpu", moe_routing_replay=True)
    cmd = cpu.command("python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert ["--device", "cpu"] == cmd[cmd.index("--device") : cmd.index("--device") + 2]
    assert "--enable-return-routed-experts" in cmd and "--max-total-tokens" in cmd
    env = engine_env("cpu", cpu_threads=1)
    assert env["PYTHONPATH"] == str(compat_dir()) and env["OMP_NUM_THREADS"] == "1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert (compat_dir() / "sitecustomize.py").is_file()

    gpu = EngineServer(tiny_moe_model, venv=tmp_path, device="cuda", extra_args=["--tp-size", "2"])
    gcmd = gpu.command("python")
    assert (
        "--device" not in gcmd
        and "--attention-backend" not in gcmd
        and gcmd[-2:] == ["--tp-size", "2"]
    )
    genv = engine_env("cuda")
    assert "SGLANG_USE_CPU_ENGINE" not in genv
    assert str(compat_dir()) not in genv.get("PYTHONPATH", "")


@pytest.mark.slow
def test_dense_model_serves_then_a_crash_is_detected(
    engine_venv: Path, tiny_dense_model: Path, tmp_path: Path
) -> None:
    """`agent-rl model init` output loads in SGLang (started with the async `astart`); killing
    the engine is noticed by check(), and stop() leaves nothing behind."""
    server = EngineServer(
        tiny_dense_model, venv=engine_venv, log_dir=tmp_path, startup_timeout_s=240
    )
    try:
        asyncio.run(server.astart())
        _serve_then_crash(server)
    finally:
        asyncio.run(server.astop())
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)  # nothing of the engine's process group is left


def _serve_then_crash(server: EngineServer) -> None:
    r = httpx.post(
        server.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    server.check()  # alive: no error

    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server.returncode is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(EngineError, match=r"exited with code -9.*log: "):
        server.check()


def test_cli_start_failure_is_one_line(tmp_path: Path) -> None:
    """`agent-rl engine start` with a bad model dir: exit 1, one line that says what to do."""
    proc = subprocess.run(
        [sys.executable, "-c", "from agent_rl.app.cli import main; main()",
         "engine", "start", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "agent-rl model init" in errors[0], proc.stderr


def test_cpu_engine_memory_is_on_huge_pages(sglang_server: EngineServer) -> None:
    """A CPU engine's large tensors (its KV cache, the buckets of an in-memory weight update)
    are on transparent huge pages (`THP_MEM_ALLOC_ENABLE`, set by `engine_env`): faulting in a
    fresh bucket 4 KB at a time was most of a weight update's time."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this host")
    assert sglang_server.pid is not None
    todo, huge_kb = [sglang_server.pid], 0
    while todo:  # the launcher's process and SGLang's scheduler and detokenizer under it
        pid = todo.pop()
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                huge_kb += int(line.split()[1])
        todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert huge_kb >= 2048, "no anonymous huge page in the engine's processes"


def test_cli_start_exits_0_on_sigterm_after_a_clean_stop(
    engine_venv: Path, tiny_dense_model: Path, tmp_path: Path
) -> None:
    """`agent-rl engine start` stopped by SIGTERM (as `kill` or a supervisor stops it; Ctrl-C
    takes the same path) while its engine starts: the engine's processes are stopped, the
    command says so and exits 0, not 130. (Sent during startup, so the test does not wait the
    half minute the engine takes to be ready; the stop is the same.)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from agent_rl.app.cli import main; main()", "engine", "start",
         "--model", str(tiny_dense_model), "--port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "AGENT_RL_ENGINE__VENV": str(engine_venv)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "starting SGLang" in line, line + proc.stderr.read()
        engine: list[int] = []
        deadline = time.monotonic() + 30
        while not engine and time.monotonic() < deadline:  # the engine process it launched
            time.sleep(0.2)
            engine = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == proc.pid]
        assert engine, "the engine was never launched"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "engine stopped" in out and "interrupted" not in err
    for pid in engine:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # nothing of the engine's process group is left


def _ppid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


_REGISTRY_CHECK = """
import json, sys
import sglang.srt.models.registry as registry
models = registry.ModelRegistry.models
imported = sorted(m for m in sys.modules if m.startswith("sglang.srt.models.")
                  and m.count(".") == 3 and m != "sglang.srt.models.registry")
served = models.get("Qwen3MoeForCausalLM")
everything = registry.import_model_classes("sglang.srt.models")
cls, arch = registry.ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])
print(json.dumps({
    "archs": sorted(models) if len(models) < 10 else None, "imported": imported,
    "same_class": served is everything.get("Qwen3MoeForCausalLM"),
    "fallback": [cls.__name__, arch],
    "supported": len(registry.ModelRegistry.get_supported_archs()), "all": len(everything),
}))
"""


def test_cpu_model_registry_imports_the_served_architecture_only(
    engine_venv: Path, tiny_moe_model: Path
) -> None:
    """Shim 7: with `--model-path` naming a Qwen3-MoE config, SGLang's registry imports the
    modules that name it, not all ~250; the class is the one a full import registers, and any
    other architecture asked for later imports the rest as before."""
    from agent_rl.engine.install import engine_python

    python = engine_python(engine_venv)
    argv = ["-", "--model-path", str(tiny_moe_model)]
    proc = subprocess.run(
        [str(python), "-c", f"import sys; sys.argv = {argv!r}\n" + _REGISTRY_CHECK],
        capture_output=True, text=True, env=engine_env("cpu"), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the modules that name it: qwen3_moe, its MTP head, and models built on it (~5, not ~270)
    assert got["archs"] is not None and "Qwen3MoeForCausalLM" in got["archs"]
    assert "sglang.srt.models.qwen3_moe" in got["imported"] and len(got["imported"]) < 20
    assert got["same_class"] is True
    assert got["fallback"] == ["LlamaForCausalLM", "LlamaForCausalLM"]
    assert got["supported"] == got["all"] > 200


def test_cpu_engine_children_are_forked_and_a_dead_scheduler_still_takes_the_engine_down(
    engine_venv: Path, tiny_dense_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shim 8: SGLang's scheduler and detokenizer are forked from the server, so only the server
    starts an interpreter (the compat layer's import hooks are installed once, in the server's
    pid); the engine serves, and a scheduler killed under it still ends the whole engine, which
    check() reports, as with spawned children."""
    monkeypatch.setenv("AGENT_RL_ENGINE_COMPAT_VERBOSE", "1")
    server = EngineServer(tiny_dense_model, venv=engine_venv, log_dir=tmp_path, device="cpu")
    try:
        server.start()
        server.wait_until_healthy()
        assert server.pid is not None
        log = server.log_path.read_text()
        installed = [ln for ln in log.splitlines() if "import hooks installed" in ln]
        assert installed == [f"[agent-rl engine compat pid={server.pid}] import hooks installed"]
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        names = sorted(Path(f"/proc/{c}/comm").read_text().strip() for c in children)
        assert names == ["sglang::detoken", "sglang::schedul"], names  # no resource tracker
        r = httpx.post(
            server.url + "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4

        scheduler = next(c for c in children if "schedul" in Path(f"/proc/{c}/comm").read_text())
        os.kill(int(scheduler), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.returncode is None and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(EngineError, match=r"exited with code"):
            server.check()
    finally:
        server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)  # nothing of the engine's process group is left
