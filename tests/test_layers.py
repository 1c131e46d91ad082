"""The code's layers point one way (ARCHITECTURE.md): the import-linter contracts hold, no two
files import each other even indirectly (function-level and TYPE_CHECKING imports counted), no
top-level folder imports another that imports it back except through the application layer,
and the standalone router loads nothing but the kernel."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_rl", "envs", "tools_sandbox", "trainer", "router", "migrations")
APPLICATION = ("agent_rl.app",)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours that `name` imports anywhere in its file (top level, inside
    functions, under TYPE_CHECKING), resolved to the longest known module."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from pkg import sub` imports the submodule; `from mod import name`, the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            module = resolve(target)
            if module is not None and module != name:
                out.add(module)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> Iterator[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> Iterator[list[str]]:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                yield from visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                yield sorted(component)

    for v in list(edges):
        if v not in index:
            yield from visit(v)


def test_the_import_walk_sees_function_level_and_type_checking_imports() -> None:
    edges = graph()
    # agent_rl.app.serve imports the router inside a function; agent_rl.sdk.env imports the sandbox
    # protocol under TYPE_CHECKING: both must be seen, or the cycle checks below prove nothing.
    assert "router.app" in edges["agent_rl.app.serve"]
    assert "agent_rl.sdk.sandbox" in edges["agent_rl.sdk.env"]
    assert list(cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})) == [["a", "b", "c"]]


def test_no_file_imports_itself_through_others() -> None:
    assert list(cycles(graph())) == []


def test_top_level_folders_point_one_way_below_the_application() -> None:
    folders: dict[str, set[str]] = {}
    for source, targets in graph().items():
        if source.startswith(APPLICATION):
            continue  # the application layer may import everything
        for target in targets:
            a, b = source.split(".")[0], target.split(".")[0]
            if a != b:
                folders.setdefault(a, set()).add(b)
    assert list(cycles(folders)) == [], folders


def folder_of(module: str, known: dict[str, Path]) -> str:
    """The package folder a module's file sits in (a package's `__init__` is its own folder)."""
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


def test_no_folder_imports_itself_through_others() -> None:
    """Grouped by the folder each file sits in, at every depth and in every layer (the
    application's included), the imports form no circle."""
    known = modules()
    folders: dict[str, set[str]] = {}
    for source, targets in graph().items():
        a = folder_of(source, known)
        for target in targets:
            b = folder_of(target, known)
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                folders.setdefault(a, set()).add(b)
    assert list(cycles(folders)) == [], folders


def test_agent_rl_has_no_file_outside_a_layer_folder() -> None:
    """The package's root holds its `__init__` and folders only: a file's path names its layer."""
    assert sorted(p.name for p in (ROOT / "agent_rl").glob("*.py")) == ["__init__.py"]


def test_a_module_outside_every_layer_breaks_the_contracts(tmp_path: Path) -> None:
    """The contracts are exhaustive: a new module in `agent_rl` or `tools_sandbox` that no layer
    names fails `lint-imports` (checked on a copy of the tree with one stray module added)."""
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "static", "templates"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    for stray in ("agent_rl/stray.py", "tools_sandbox/stray.py"):
        (tmp_path / stray).write_text('"""in no layer"""\n')
        out = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env={"PYTHONPATH": str(tmp_path)})
        assert out.returncode != 0 and stray.replace("/", ".").removesuffix(".py") in out.stdout, out.stdout
        (tmp_path / stray).unlink()


def test_import_linter_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_the_router_loads_only_the_kernel() -> None:
    probe = (
        "import json, sys; import router.app; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('agent_rl', 'envs', 'torch', 'tools_sandbox', 'trainer', 'migrations'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    loaded = json.loads(out.stdout)
    kernel = [m for m in loaded if m == "agent_rl" or m.startswith(("agent_rl.kernel", "agent_rl.config"))]
    assert "agent_rl.config" in kernel  # the probe sees what the router imports
    assert sorted(set(loaded) - set(kernel)) == []
