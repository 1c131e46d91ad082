"""The README and docs/ stay true to the tree: their links resolve (files and headings), the
paths they name exist, the README's example environment runs as written in a fresh interpreter,
its test command is the one CI runs, and docs/layers.md's table names every layer of
pyproject's import-linter contracts in the row of its layer."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path of ours in backticks: `agent_rl/app/serve.py`, `tests/rollout/`, `docs/trainer.md`.
PATH = re.compile(
    r"`((?:agent_rl|trainer|router|tools_sandbox|envs|bench|tests|migrations|docs|\.ci)/[\w./-]*)`"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page: Path) -> None:
    missing = [
        p for p in PATH.findall(page.read_text())
        if "NAME" not in p and "screenshots" not in p and not (ROOT / p.rstrip(".")).exists()
    ]  # fmt: skip (placeholders, and what the browser tests write)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; keep it a front page (<= 160)"


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = ci.index("# The README's test command, verbatim:")
    command = ci[marker + 1].strip()
    assert command in (ROOT / "README.md").read_text().splitlines()


def test_readme_example_environment_runs() -> None:
    """In a fresh interpreter, as a user's module would: `from agent_rl import ...` first."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"## A first environment\n\n```python\n(.*?)```", readme, re.S)
    assert found, "README.md lost its example environment"
    code = found.group(1).replace("    ...\n", "    return str(eval(expression))\n", 1)
    check = code + (
        "\nimport asyncio\n"
        "from agent_rl import make, parse_completion\n"
        "from agent_rl.sdk.tool_calls import format_tool_call\n"
        "env = make('my-calculator')\n"
        "task = next(iter(env.task_source().stream(0)))\n"
        "async def main():\n"
        "    first = await env.reset(task, 0)\n"
        "    assert [t['function']['name'] for t in first.tools] == ['calc'], first.tools\n"
        "    call = format_tool_call('calc', {'expression': '3*4+8'})\n"
        "    called = await env.step(parse_completion(call))\n"
        "    assert called.observations and '20' in str(called.observations[0]), called\n"
        "    done = await env.step(parse_completion(task['answer']))\n"
        "    assert done.terminated and done.reward == 1.0, done\n"
        "asyncio.run(main())\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _layer_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "layers.md").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| (L\d) .*$", text, re.M)}


def test_layers_table_matches_the_contracts() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    by_name = {c["name"]: c for c in contracts["contracts"]}
    rows = _layer_rows()
    assert set(rows) == {"L0", "L1", "L2", "L3"}, rows
    # agent_rl's own contract: app (L3), then the subsystems, the contracts and data over the
    # model families (both L1), L0 twice
    inside = next(c for c in by_name.values() if c.get("containers") == ["agent_rl"])
    levels = ["L3", "L2", "L1", "L1", "L0", "L0"]
    assert len(inside["layers"]) == len(levels), inside["layers"]
    missing = []
    for level, layer in zip(levels, inside["layers"]):
        for name in re.split(r"[|:]", layer):
            if f"agent_rl/{name.strip()}/" not in rows[level]:
                missing.append(f"agent_rl/{name.strip()}/ in {level}")
    # the project's contract: the other top-level packages and tools_sandbox's L1 modules
    project = next(c for c in by_name.values() if "containers" not in c and c["type"] == "layers")
    assert len(project["layers"]) == len(levels), project["layers"]
    for level, layer in zip(levels, project["layers"]):
        for name in (n.strip() for n in re.split(r"[|:]", layer)):
            if name.startswith("agent_rl"):
                continue
            shown = f"{name.replace('.', '/')}.py" if "." in name else f"{name}/"
            if shown not in rows[level]:
                missing.append(f"{shown} in {level}")
    assert not missing, f"docs/layers.md's table does not show: {missing}"
