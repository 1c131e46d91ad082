"""`long_lived_heap`: what serve's collector settings are while it serves, and after; and the CLI's
bracket around a command's imports (`imports_begin` / `imports_end`)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from agent_rl.kernel.heap import YOUNG_THRESHOLD, long_lived_heap


def test_freezes_the_heap_and_restores_the_collector_after() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    alive = [object() for _ in range(10)], {"a": [1]}  # tracked containers alive at entry
    with long_lived_heap():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > frozen_before
        scanned = {id(o) for o in gc.get_objects()}
        assert all(gc.is_tracked(c) and id(c) not in scanned for c in alive)  # frozen out of the scans
        cycle: list[object] = []
        cycle.append(cycle)  # a cycle made while serving is still the collector's to find
        assert any(o is cycle for o in gc.get_objects(generation=0))
        del cycle
        assert gc.collect() >= 1
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_nested_uses_keep_the_outermost_settings() -> None:
    before = gc.get_threshold()
    with long_lived_heap(young=5_000):
        with long_lived_heap(young=9_000):
            assert gc.get_threshold()[0] == 5_000
        assert gc.get_threshold()[0] == 5_000  # the inner exit does not restore
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before


def test_imports_begin_and_end_bracket_a_commands_imports() -> None:
    from agent_rl.kernel.heap import imports_begin, imports_end

    frozen_before = gc.get_freeze_count()
    imports_begin()
    try:
        assert not gc.isenabled()
        made = [{"i": i} for i in range(100)]  # what the imports make, alive after them
    finally:
        imports_end()
    try:
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(made)
        imports_end()  # a second end changes nothing
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_imports_begin_leaves_a_collector_the_caller_disabled_alone() -> None:
    from agent_rl.kernel.heap import imports_begin, imports_end

    gc.disable()
    try:
        imports_begin()
        imports_end()
        assert not gc.isenabled()  # not ours to turn on
    finally:
        gc.enable()


def test_a_cli_command_imports_without_collections(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`agent-rl episodes list` as a user runs it: no collection runs while the command's module
    and its libraries (config, store, SQLAlchemy) are imported (146 did without the bracket), the
    collector is back on for the command itself, and the command works."""
    env = {**os.environ, "AGENT_RL_STORE__URL": f"sqlite:///{tmp_path / 'store.db'}"}
    subprocess.run([sys.executable, "-m", "agent_rl.app.cli", "db", "upgrade"], env=env, check=True,
                   capture_output=True)
    # The command, with the collections and modules counted when main() starts and when the
    # command's imports end; each count is one JSON line on stderr.
    count = (
        "import gc, json, sys\n"
        "n = [0]\n"
        "gc.callbacks.append(lambda phase, info: n.__setitem__(0, n[0] + (phase == 'start')))\n"
        "def say(**kw): print(json.dumps(dict(collections=n[0], modules=len(sys.modules), **kw)), file=sys.stderr)\n"
        "sys.argv = ['agent-rl', 'episodes', 'list']\n"
        "import agent_rl.app.cli as cli\n"
        "end = cli.imports_end\n"
        "def imports_end():\n"
        "    end()\n"
        "    say(enabled=gc.isenabled())\n"
        "cli.imports_end = imports_end\n"
        "say()\n"
        "cli.main()\n"
    )
    done = subprocess.run([sys.executable, "-c", count], env=env, check=True, capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.stdout.endswith("0 episodes\n")
    before, after = map(json.loads, done.stderr.splitlines()[-2:])
    assert before["collections"] == after["collections"], done.stderr  # none in between
    assert after["modules"] > before["modules"] + 300  # the store's libraries came in between
    assert after["enabled"] is True
