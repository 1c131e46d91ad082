"""Fixtures shared across the test packages.

Integration tests use the real components: SQLite and PostgreSQL, real HTTP servers on loopback,
real SGLang on CPU, real megatron-core on CPU. PostgreSQL tests read AGENT_RL_TEST_POSTGRES_URL;
in CI (CI=true) they must run, so a missing URL is an error there rather than a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests._databases import fresh_database

if TYPE_CHECKING:
    from agent_rl.engine.launcher import EngineServer
    from tests._engine_scripts import EngineScripts


# Where the tests of each `one_at_a_time` group are: under `-n 2` the scheduler below sends each
# group's tests to one worker, so a worker never waits on its group's lock while the other runs
# a test of the group (a Ray test once waited 124 s so). A test whose mark and this table
# disagree fails, so the table cannot fall behind the marks.
# "fleet": the tests that start a fleet of processes, a Ray cluster (two clusters side by side
# took each other's ports) or a whole run's engines, serves and trainer (the quickstarts: two
# side by side each took about twice as long, their RL stages starving each other's CPU).
ONE_AT_A_TIME = {
    "fleet": ("tests/cluster/test_launch.py", "tests/quickstart/test_on_ray.py",
              "tests/cluster/test_slurm.py::test_real_ray_cluster_of_two_nodes",
              "tests/quickstart/test_quickstart.py", "tests/quickstart/test_quickstart_agent.py"),
}  # fmt: skip


def _group_of(nodeid: str) -> str | None:
    for group, prefixes in ONE_AT_A_TIME.items():
        if any(nodeid == p or nodeid.startswith(p + "::") for p in prefixes):
            return group
    return None


@pytest.fixture(autouse=True)
def _cpu_exclusive(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist (the README's `-n 2`), a test marked `cpu_exclusive` runs while every
    other worker waits between tests: its subject is a process that only gets idle CPU (an
    evaluator under SCHED_IDLE), which a second worker keeping both cores busy would starve. A
    test marked `one_at_a_time(GROUP)` runs while no other test of its group runs, and beside
    any other test: the tests that start a fleet of processes are one group (a Ray cluster: two
    started side by side took each other's ports; a whole run: two starve each other's CPU). (The scheduler below already gives a group to one worker; the lock keeps
    it so under any other `--dist`. pytest-xdist's own `--dist loadgroup` does not group under
    pytest 9: the node id it rewrites is no longer the one reported.)

    Flocks shared by the workers. A grouped test first takes its group's lock, holding nothing
    else meanwhile. Then every test takes the turnstile, then the gate (shared, or exclusive for
    a `cpu_exclusive` test), then lets the turnstile go. A marked test waiting for the gate holds
    the turnstile, so no other test slips in before it (the kernel's flock alone does not favour
    the exclusive waiter)."""
    grouped = request.node.get_closest_marker("one_at_a_time")
    marked = grouped.args[0] if grouped is not None else None
    if _group_of(request.node.nodeid) != marked:
        pytest.fail(f"its one_at_a_time mark ({marked}) and tests/conftest.py's ONE_AT_A_TIME "
                    f"({_group_of(request.node.nodeid)}) disagree: list it there, or mark it")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    exclusive = request.node.get_closest_marker("cpu_exclusive") is not None
    base = Path(tempfile.gettempdir()) / f"agent-rl-tests-{run}"
    with contextlib.ExitStack() as held:
        if grouped is not None:
            group = held.enter_context(open(f"{base}.group-{grouped.args[0]}", "a"))
            fcntl.flock(group, fcntl.LOCK_EX)  # released when the file closes
        turnstile = held.enter_context(open(f"{base}.turnstile", "a"))
        gate = held.enter_context(open(f"{base}.gate", "a"))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's default `load` distribution, except that each `one_at_a_time` group's
    tests go to one worker only (the first one sent any), so no worker idles on a group's lock.

    An xdist worker starts a test only once it holds the next one or was told to shut down (the
    next test decides which fixtures to tear down), and the scheduler acts only when a test ends.
    So after every decision each worker is settled: given a second test if it may take one, or
    told to shut down once nothing pending is for it (pending only shrinks, so nothing will be).
    Without that, a worker holding one test while the rest pending were another worker's group
    never started it (a run of two grouped tests hung so)."""
    if config.getoption("dist") != "load":
        return None  # the user chose another distribution: theirs
    from xdist.scheduler import LoadScheduling

    class GroupsOnOneWorker(LoadScheduling):
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.owners: dict[str, Any] = {}  # group -> the worker that runs it

        def _may_take(self, node: Any, index: int) -> bool:
            """Whether `node` may run pending test `index`: ungrouped, its group's, or a
            group no live worker has claimed."""
            group = _group_of(self.collection[index])
            owner = self.owners.get(group) if group is not None else node
            return owner is node or owner not in self.node2pending

        def _send_tests(self, node: Any, num: int) -> None:
            chosen: list[int] = []
            for index in self.pending:
                if len(chosen) == num:
                    break
                if self._may_take(node, index):
                    chosen.append(index)
            for index in chosen:  # the worker sent a group's first test claims the group
                group = _group_of(self.collection[index])
                if group is not None:
                    self.owners[group] = node
            if chosen:
                sent = set(chosen)
                self.pending[:] = [i for i in self.pending if i not in sent]
                self.node2pending[node].extend(chosen)
                node.send_runtest_some(chosen)

        def _settle(self) -> None:
            for node, queued in list(self.node2pending.items()):
                if not node.shutting_down and len(queued) < 2:
                    self._send_tests(node, 2 - len(queued))
            for node in list(self.node2pending):
                if not node.shutting_down and not any(self._may_take(node, i) for i in self.pending):
                    node.shutdown()

        def schedule(self) -> None:
            super().schedule()
            self._settle()

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            self._settle()

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            self._settle()
            return crashed

    return GroupsOnOneWorker(config, log)


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database URL, once on SQLite and once on PostgreSQL."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


# --- tiny models (agent_rl.models) -------------------------------------------------------------
# Session-scoped: every test package shares one directory per preset (about a second each).


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-dense model directory (Qwen2, ~3M parameters, seed 0)."""
    from agent_rl.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-dense", "tiny-dense", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-moe model directory (Qwen3-MoE, 8 experts, top-2, 2 layers, seed 0)."""
    from agent_rl.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-moe", "tiny-moe", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-llama model directory as its preset makes it (untied embeddings, like Llama 3.1
    8B; 4 layers, seed 0)."""
    from agent_rl.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-llama", "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama with Llama 3.2 1B/3B's tied embeddings and Llama 3's rope scaling (theta 1e4,
    `llama3` factor 8 from an original context of 512, which megatron-core's constructor does
    not scale by: the built model applies it), 4 layers, seed 0: the paths the preset does not
    take (the tied output layer, the rope scaling) kept under test."""
    from agent_rl.models import init_model

    out = tmp_path_factory.mktemp("models") / "tiny-llama-tied"
    return init_model(out, "tiny-llama", seed=0, tie_word_embeddings=True, rope_theta=10000.0,
                      options={"rope_scaling_factor": 8.0, "rope_original_context": 512})  # fmt: skip


# --- SGLang engines (agent_rl.engine) ----------------------------------------------------------
# A server costs 20-35 s and ~2 GB, so the session shares ONE: `sglang_moe_server` (tiny-moe with
# routing replay), also available as `sglang_server`. Fixtures are lazy: only tests that ask for a
# server start it. Tests that change its state (weights, pause) must restore it before returning.
# Without the engine environment these tests skip locally and fail in CI (CI=true).


@pytest.fixture(scope="session")
def engine_venv() -> Path:
    """The engine environment made by `agent-rl engine install` (engine.venv)."""
    from agent_rl.config import load_config
    from agent_rl.engine.install import INSTALL_HINT, is_installed

    venv = load_config().engine.venv
    if not is_installed(venv):
        message = f"no engine environment at {venv}: {INSTALL_HINT}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return venv


@pytest.fixture(scope="session")
def engine_scripts(engine_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineScripts]:
    """Scripts run by the engine environment's python with SGLang already imported
    (tests/_engine_scripts.py): `engine_scripts.run(script, *args)` -> CompletedProcess."""
    from tests._engine_scripts import EngineScripts

    scripts = EngineScripts(engine_venv, tmp_path_factory.mktemp("engine-scripts"))
    yield scripts
    scripts.close()


@pytest.fixture(scope="session")
def sglang_server_factory(
    engine_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., EngineServer]]:
    """start(model_dir, **EngineServer kwargs) -> a healthy EngineServer, stopped at session end."""
    from agent_rl.engine.launcher import EngineServer

    started: list[EngineServer] = []
    log_dir = tmp_path_factory.mktemp("engine-logs")

    def start(model: Path, **kwargs: Any) -> EngineServer:
        kwargs.setdefault("log_dir", log_dir)
        kwargs.setdefault("startup_timeout_s", 240.0)
        server = EngineServer(model, venv=engine_venv, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def sglang_moe_server(
    sglang_server_factory: Callable[..., EngineServer], tiny_moe_model: Path
) -> EngineServer:
    """The session's SGLang server: tiny-moe (8 experts, top-2, 2 layers), routing replay on.
    Use `.url`; weight_version is "default" between tests."""
    return sglang_server_factory(tiny_moe_model, moe_routing_replay=True)


@pytest.fixture(scope="session")
def sglang_server(sglang_moe_server: EngineServer) -> EngineServer:
    """Any SGLang server for tests that just need generation: the shared tiny-moe one."""
    return sglang_moe_server
