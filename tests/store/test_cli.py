"""`agent-rl db` and `agent-rl episodes` as a user runs them, against SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from tests.store.helpers import completed_group, make_turn, migrated_store

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")


def cli(*args: str, url: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    if url is not None:
        env["AGENT_RL_STORE__URL"] = url
    env["COLUMNS"] = "200"
    return subprocess.run([AGENT_RL, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def assert_one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0]


def test_upgrade_list_show(db_url: str) -> None:
    import anyio

    assert cli("db", "upgrade", url=db_url).returncode == 0
    assert "(head)" in cli("db", "current", url=db_url).stdout
    empty = cli("episodes", "list", url=db_url)
    assert empty.returncode == 0 and "0 episodes" in empty.stdout

    async def fill() -> list[int]:
        async with await migrated_store(db_url) as store:
            run = await store.ensure_run("cli")
            _, eps = await completed_group(store, run, size=2, version=3)
            task = await store.add_task(run, "search-qa", "q1", {})
            _, (failed,) = await store.admit_group(run, task, "search-qa", 1)
            await store.start_episode(failed, "s")
            await store.append_turn(failed, make_turn(9))
            await store.fail_episode(failed, "SandboxError", "sandbox died: killed for memory")
            return [*eps, failed]

    eps = anyio.run(fill)
    listed = cli("episodes", "list", url=db_url)
    assert listed.returncode == 0 and "3 episodes" in listed.stdout
    rows = [json.loads(line) for line in cli("episodes", "list", "--json", url=db_url).stdout.splitlines()]
    assert [r["id"] for r in rows] == eps

    def ids(*flags: str) -> list[int]:
        out = cli("episodes", "list", "--json", *flags, url=db_url)
        assert out.returncode == 0, out.stderr
        return [json.loads(line)["id"] for line in out.stdout.splitlines()]

    assert ids("--status", "failed") == [eps[2]]
    assert ids("--env", "calculator") == eps[:2]
    assert ids("--min-reward", "0.5") == [eps[1]]
    assert ids("--max-reward", "0.5") == [eps[0]]
    assert ids("--min-version", "3", "--max-version", "3") == eps[:2]
    assert ids("--run", "cli", "--after", str(eps[0])) == eps[1:]
    assert ids("--text", "OBS 9") == [eps[2]] and ids("-q", "act") == eps
    table = cli("episodes", "list", "-q", "obs 9", url=db_url).stdout.splitlines()
    assert table[0].split() == ["id", "env", "group", "status", "reward", "turns", "tokens",
                                "versions", "cause"]
    assert table[2].split()[:4] == [str(eps[2]), "search-qa", table[2].split()[2], "failed"]
    assert table[-1] == "1 episodes"
    for out_of_range in (str(2**31), str(2**63)):  # beyond the 32-bit ids: refused, no traceback
        refused = cli("episodes", "show", out_of_range, url=db_url)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        listed = cli("episodes", "list", "--after", out_of_range, url=db_url)
        assert listed.returncode != 0 and "Traceback" not in listed.stderr

    shown = cli("episodes", "show", str(eps[2]), url=db_url)
    assert shown.returncode == 0
    assert "sandbox died: killed for memory" in shown.stdout and "calc" in shown.stdout
    detail = json.loads(cli("episodes", "show", str(eps[0]), "--json", url=db_url).stdout)
    assert detail["episode"]["num_tokens"] == 12 and len(detail["turns"]) == 1
    assert detail["tool_calls"][0]["name"] == "calc"


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[store]\nurll = "sqlite:///x.db"\n')
    assert_one_line_error(cli("--config", str(bad), "config", "show"), "unknown key 'store.urll'", str(bad))
    assert_one_line_error(cli("config", "check", str(bad)), "store.urll")
    assert_one_line_error(cli("--config", str(tmp_path / "missing.toml"), "db", "upgrade"), "does not exist")
    (tmp_path / "syntax.toml").write_text("[store\n")
    assert_one_line_error(cli("config", "check", str(tmp_path / "syntax.toml")), "invalid TOML")

    unreachable = "postgresql://nobody@127.0.0.1:1/none"
    assert_one_line_error(cli("episodes", "list", url=unreachable), "cannot open the store", "store.url")
    assert_one_line_error(cli("db", "upgrade", url=unreachable), "cannot open the store")
    assert_one_line_error(cli("episodes", "list", url="mysql://x/y"), "store.url")

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert_one_line_error(cli("episodes", "list", url=fresh), "agent-rl db upgrade")
    assert cli("db", "upgrade", url=fresh).returncode == 0
    assert_one_line_error(cli("episodes", "show", "424242", url=fresh), "episode 424242 does not exist")


def test_config_file_and_environment(tmp_path: Path) -> None:
    (tmp_path / "agent-rl.toml").write_text('[run]\nname = "from-file"\n')
    shown = json.loads(cli("config", "show", "--json", cwd=tmp_path).stdout)
    assert shown["run"]["name"] == "from-file"
    env_wins = cli("config", "show", "--json", cwd=tmp_path, url="sqlite:///other.db")
    assert json.loads(env_wins.stdout)["store"]["url"] == "sqlite:///other.db"
    assert cli("config", "check", str(tmp_path / "agent-rl.toml")).returncode == 0


# What a listing never needs: the engine's, the trainer's and the web servers' libraries, the
# console renderer, the migrations, the retry machinery (until a fault), PostgreSQL's driver on
# SQLite; and of this project only the CLI, the config, the kernel and the store.
NOT_FOR_A_LISTING = ("torch", "transformers", "tokenizers", "numpy", "megatron", "sglang",
                     "fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "jinja2", "rich",
                     "alembic", "tenacity", "opentelemetry", "openai", "docker", "psycopg",
                     "envs", "trainer", "router", "tools_sandbox", "migrations")  # fmt: skip
OURS_FOR_A_LISTING = ("agent_rl.app.cli", "agent_rl.config", "agent_rl.kernel", "agent_rl.store")


def test_episodes_list_loads_only_what_it_needs(tmp_path: Path) -> None:
    """`agent-rl episodes list` is mostly its imports (bench/api.py): the modules it has loaded
    when it is done, in its own process, hold none of the heavy or unrelated ones. A lazy import
    made eager again anywhere on its path fails here, whatever the machine's speed."""
    import anyio

    from agent_rl.config import StoreConfig
    from agent_rl.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'store.db'}"
    anyio.run(upgrade, StoreConfig(url=url))
    probe = (
        "import json, sys\n"
        "sys.argv = ['agent-rl', 'episodes', 'list']\n"
        "from agent_rl.app.cli import main\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    done = subprocess.run([sys.executable, "-c", probe], env={**env, "AGENT_RL_STORE__URL": url},
                          capture_output=True, text=True, cwd=tmp_path, timeout=60, check=True)  # fmt: skip
    assert done.stdout.endswith("0 episodes\n")
    loaded = json.loads(done.stderr.splitlines()[-1])
    assert "sqlalchemy.orm" in loaded and "agent_rl.store.queries" in loaded  # the probe sees them
    heavy = [m for m in loaded if m.split(".")[0] in NOT_FOR_A_LISTING]
    assert heavy == []
    ours = [m for m in loaded if m.startswith("agent_rl.")
            and not m.startswith(tuple(f"{p}." for p in OURS_FOR_A_LISTING))
            and m not in OURS_FOR_A_LISTING and m != "agent_rl.app"]  # fmt: skip
    assert ours == []
