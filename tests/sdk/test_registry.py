"""register/make, the decorator form, sources, and discovery of an installed plugin package.

The plugin test builds a real distribution in a temporary directory outside the project, installs
it with pip (into a target directory put on the path, so the shared environment is left as it
was), and checks both in-process discovery and `agent-rl envs list` in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_rl import Env, EnvError, Task, make, register
from agent_rl.sdk import registry
from agent_rl.sdk.env import EnvCodeError
from agent_rl.sdk.messages import Message, user

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class TinyEnv(Env):
    """Say the word."""

    def __init__(self, word: str = "hello", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.word = word

    def initial_messages(self, task: Task) -> list[Message]:
        return [user(self.word)]

    async def score(self, answer: str) -> float:
        return float(answer == self.word)


@pytest.fixture
def scratch_ids() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for i in ids:
        registry.unregister(i)


def test_register_make_with_defaults_and_overrides(scratch_ids: list[str]) -> None:
    scratch_ids.append("tiny-test")
    register("tiny-test", entry_point=f"{__name__}:TinyEnv", word="hey", max_turns=3)
    env = make("tiny-test")
    assert (
        isinstance(env, TinyEnv)
        and env.word == "hey"
        and env.max_turns == 3
        and env.env_id == "tiny-test"
    )
    assert make("tiny-test", word="yo").word == "yo"
    s = registry.spec("tiny-test")
    assert s.source == f"module {__name__}" and s.kwargs == {"word": "hey", "max_turns": 3}


def test_decorator_form_and_conflicts(scratch_ids: list[str]) -> None:
    scratch_ids.append("tiny-deco")

    @register("tiny-deco", word="deco")
    class Deco(TinyEnv):
        pass

    assert type(make("tiny-deco")) is Deco and make("tiny-deco").word == "deco"
    register("tiny-deco", Deco, word="deco")  # same entry point again: idempotent
    with pytest.raises(EnvError, match="already registered"):
        register("tiny-deco", entry_point=f"{__name__}:TinyEnv")
    with pytest.raises(EnvError, match="not a subclass"):
        register("tiny-bad", int)  # type: ignore[arg-type]
    with pytest.raises(EnvError, match="package.module:Class"):
        register("tiny-bad", entry_point="no_colon")


def test_unknown_id_and_broken_entry_points_are_env_errors(scratch_ids: list[str]) -> None:
    with pytest.raises(EnvError, match="unknown environment 'nope'.*calculator"):
        make("nope")
    scratch_ids += ["tiny-missing", "tiny-kwargs"]
    register("tiny-missing", entry_point="tests.sdk.no_such_module:Env")
    with pytest.raises(EnvCodeError) as e:
        make("tiny-missing")
    assert e.value.method == "import" and "ModuleNotFoundError" in e.value.traceback
    register("tiny-kwargs", entry_point=f"{__name__}:TinyEnv", colour="red")
    with pytest.raises(EnvCodeError, match="unexpected keyword argument 'colour'"):
        make("tiny-kwargs")


def test_builtins_are_listed_as_builtin() -> None:
    by_id = {s.id: s for s in registry.specs()}
    for env_id in ("calculator", "search-qa"):
        assert by_id[env_id].source == "builtin"


PLUGIN_MODULE = '''
from agent_rl import Env, register
from agent_rl.sdk.messages import user


class PluginEnv(Env):
    """An environment from an installed package."""

    def initial_messages(self, task):
        return [user("plug")]

    async def score(self, answer):
        return 1.0


class SelfRegistered(PluginEnv):
    """Registered by the module itself."""


register("plugin-self", SelfRegistered)
'''


TUNED_MODULE = '''
from agent_rl_plugin_demo import PluginEnv


class TunedEnv(PluginEnv):
    """Made with the defaults its package registered."""

    def __init__(self, *, level: str = "easy", **kwargs):
        super().__init__(**kwargs)
        self.level = level
'''

# Registration defaults for an entry point (docs/envs.md): a module entry point that registers
# the class by name, so that the class's module is imported only when the env is made.
REGISTRATION_MODULE = '''
from agent_rl import register

register("plugin-tuned", entry_point="agent_rl_plugin_demo.tuned:TunedEnv", max_turns=3,
         level="hard")
'''


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`agent-rl-plugin-demo` 0.3.0 built and installed (pip --target) from a tmp dir."""
    src = tmp_path_factory.mktemp("plugin-src")
    assert PROJECT_ROOT not in src.parents
    (src / "agent_rl_plugin_demo").mkdir()
    (src / "agent_rl_plugin_demo" / "__init__.py").write_text(PLUGIN_MODULE)
    (src / "agent_rl_plugin_demo" / "tuned.py").write_text(TUNED_MODULE)
    (src / "agent_rl_plugin_demo" / "registration.py").write_text(REGISTRATION_MODULE)
    (src / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "agent-rl-plugin-demo"
        version = "0.3.0"

        [project.entry-points."agent_rl.envs"]
        plugin-env = "agent_rl_plugin_demo:PluginEnv"
        plugin-module = "agent_rl_plugin_demo"
        plugin-broken = "agent_rl_plugin_demo_missing:Nope"
        plugin-defaults = "agent_rl_plugin_demo.registration"
    """)
    )
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return target


def test_entry_point_plugin_is_discovered(
    installed_plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(installed_plugin))
    try:
        registry.discover(force=True)
        by_id = {s.id: s for s in registry.specs()}
        assert by_id["plugin-env"].source == "entry point: agent-rl-plugin-demo 0.3.0"
        assert by_id["plugin-self"].source == "entry point: agent-rl-plugin-demo 0.3.0"
        assert type(make("plugin-env")).__name__ == "PluginEnv"
        assert type(make("plugin-self")).__name__ == "SelfRegistered"
        tuned = by_id["plugin-tuned"]
        assert tuned.source == "entry point: agent-rl-plugin-demo 0.3.0"
        assert tuned.kwargs == {"max_turns": 3, "level": "hard"}
        assert "agent_rl_plugin_demo.tuned" not in sys.modules  # lazy until made
        env = make("plugin-tuned")
        assert (type(env).__name__, env.max_turns, env.level) == ("TunedEnv", 3, "hard")
        assert make("plugin-tuned", max_turns=5).max_turns == 5
        # A lazy entry point that cannot be imported fails when made (and listed), not discovered.
        with pytest.raises(EnvCodeError, match="ModuleNotFoundError"):
            make("plugin-broken")
        rows = {r["id"]: r for r in map(registry.describe, registry.specs())}
        assert rows["plugin-env"]["description"] == "An environment from an installed package."
        assert rows["plugin-env"]["tools"] == [] and rows["plugin-env"]["sandbox"] is False
        assert "ModuleNotFoundError" in rows["plugin-broken"]["error"]
        assert rows["calculator"]["tools"] == ["calc"] and rows["calculator"]["demonstration"]
    finally:
        for i in ("plugin-env", "plugin-self", "plugin-broken", "plugin-tuned"):
            registry.unregister(i)


CLI_SCRIPT = """
from agent_rl.app.cli import app
for args in (["envs", "list", "--json"], ["envs", "list"]):
    try:
        app(args)
    except SystemExit as e:
        assert not e.code, e.code
    print("\\n--- end of command ---")
"""


def test_cli_envs_list_shows_the_plugin_and_its_distribution(installed_plugin: Path) -> None:
    # A fresh process through the real CLI: discovery must find the installed distribution.
    # Both forms run in one process because importing the CLI is the slow part.
    path = os.pathsep.join([str(installed_plugin), str(PROJECT_ROOT)])
    env = dict(os.environ, PYTHONPATH=path, COLUMNS="250")
    out = subprocess.run(
        [sys.executable, "-c", CLI_SCRIPT], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    as_json, table, _ = out.stdout.split("--- end of command ---")
    rows = {r["id"]: r for r in json.loads(as_json)["envs"]}
    assert rows["plugin-env"]["source"] == "entry point: agent-rl-plugin-demo 0.3.0"
    assert rows["calculator"]["source"] == "builtin" and rows["calculator"]["tools"] == ["calc"]
    assert {"calculator", "search-qa", "python-math", "code-tests"} <= rows.keys()
    assert "plugin-env" in table and "entry point: agent-rl-plugin-demo 0.3.0" in table
    assert "cannot load" in table and "builtin" in table
