"""The sandbox contract's value types (`agent_rl.sdk.sandbox`): paths confined to /work, specs
usable as pool keys."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent_rl.kernel.errors import ToolError
from agent_rl.sdk.sandbox import ExecResult, Limits, Mount, SandboxSpec, work_path


def test_work_path_confines_to_the_work_dir() -> None:
    assert work_path("a/b.txt") == "a/b.txt"
    assert work_path("/work/a/../b.txt") == "b.txt"
    assert work_path("./x//y/") == "x/y"
    for bad in ("../etc/passwd", "/etc/passwd", "/work", "a/../..", "/workshop/x", "."):
        with pytest.raises(ToolError):
            work_path(bad)


def test_specs_are_hashable_and_compare_by_value() -> None:
    a = SandboxSpec(limits=Limits(wall_s=5), env={"B": "2", "A": "1"})
    b = SandboxSpec(limits=Limits(wall_s=5), env=(("A", "1"), ("B", "2")))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, SandboxSpec()}) == 2
    with pytest.raises(ValidationError):
        SandboxSpec(limits=Limits(wall_s=0))
    with pytest.raises(ValidationError):
        SandboxSpec(mounts=(Mount(source="/data", target="/work/data"),))
    with pytest.raises(ValidationError):
        Mount(source="data", target="/data")


def test_result_ok_means_finished_cleanly() -> None:
    assert ExecResult(exit_code=0).ok
    assert not ExecResult(exit_code=0, truncated=True).ok
    assert not ExecResult(exit_code=0, oom_killed=True).ok
    assert not ExecResult(exit_code=None, restarted=True).ok
    assert not ExecResult(exit_code=1).ok
