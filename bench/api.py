"""The read paths at 10k episodes: `agent-rl episodes list`, text search `q`, and `/stats`.

A store of ~10k episodes is built on SQLite (a temp file) and on PostgreSQL (a throwaway
database on AGENT_RL_TEST_POSTGRES_URL, default the local test server): a small real run is
written through the store's API as the runner writes it (tests/api/fill.py: demonstrated
calculator episodes with tool calls, a trained group, a failed and a running episode), then
its rows are cloned in SQL, doubling until the target, every id and foreign key offset (so the
text search index and every other index see ordinary inserts). Then every message gets text of
its own (a Zipf draw of words, ~600 characters on average, as completions, tool outputs and
prompts run) and each assistant message its episode's tag `ep<id>`, so a search can hit one
episode, many (a common word) or none.

Measured, side by side in one run:
- `agent-rl episodes list` (100 rows) on both databases and `--limit 10000` (SQLite), as a
  subprocess, the way a user runs it (bytecode cached; the first run warms it), median of
  several runs, wall and CPU seconds, beside a process that only imports the libraries the
  command is built on (SQLAlchemy's ORM, pydantic-settings, Typer, anyio's asyncio backend,
  imported with the collector off as the command imports them): the floor under it;
- `GET /api/v1/episodes?q=...` over real HTTP for a set of terms (`search_terms`: the most
  common words, a mid-frequency one, tags of one episode, `ep1` whose matches are all far down
  the newest-first order, and a word in no message), the median of each, and the worst term,
  against the same query with the scan that revision 0003 replaced (`EXISTS ... ILIKE` over
  every message), run on the same store;
- `GET /api/v1/stats`.
Last line: RESULT {"cli_list_s" (SQLite), "cli_list_s_postgres", "q_worst_ms_sqlite",
"q_worst_ms_postgres", "stats_ms"} (q_worst: the slowest term's median; stats_ms is the worse of
the two backends), and more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
from sqlalchemy import Engine, bindparam, func, select, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.app.api import create_app  # noqa: E402
from agent_rl.app.api.app import EmbeddedServer  # noqa: E402
from agent_rl.config import Config, StoreConfig  # noqa: E402
from agent_rl.store import Store  # noqa: E402
from agent_rl.store.db import create_database  # noqa: E402
from agent_rl.store.migrate import upgrade  # noqa: E402
from agent_rl.store.models import MESSAGE_SEARCH, Base, EpisodeRow, MessageRow  # noqa: E402
from tests._databases import fresh_postgres  # noqa: E402
from tests.api.fill import fill  # noqa: E402

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")
CLONED = ["tasks", "groups", "episodes", "turns", "messages", "tool_calls"]


async def template(url: str, tokenizer_dir: Path) -> None:
    """A small real run, written through the store's API (tests/api/fill.py)."""
    from agent_rl.app.api.tokens import load_tokenizer

    cfg = StoreConfig(url=url)
    await upgrade(cfg)
    async with await Store.open(cfg) as store:
        await fill(store, load_tokenizer(str(tokenizer_dir)), str(tokenizer_dir))


def clone_to(db: Engine, target: int, mean_chars: int) -> int:
    """Double the cloned tables' rows until there are `target` episodes; returns how many."""
    tables = {t.name: t for t in Base.metadata.sorted_tables if t.name in CLONED}
    while True:
        with db.begin() as conn:
            n = conn.scalar(select(func.count()).select_from(EpisodeRow))
            if n >= target:
                break
            offsets = {name: conn.scalar(select(func.coalesce(func.max(t.c.id), 0)))
                       for name, t in tables.items()}
            # The last round clones only the episodes (and their rows) still missing.
            cutoff = offsets["episodes"] if 2 * n <= target else target - n
            owned = {"episodes": "id", "turns": "episode_id", "messages": "episode_id",
                     "tool_calls": "episode_id"}
            for name in CLONED:
                t = tables[name]
                columns = []
                for c in t.columns:
                    refs = [fk.column.table.name for fk in c.foreign_keys]
                    source = name if c.primary_key else (refs[0] if refs else None)
                    offset = offsets.get(source) if source else None
                    columns.append(f'"{c.name}" + {offset}' if offset else f'"{c.name}"')
                names = ", ".join(f'"{c.name}"' for c in t.columns)
                where = f' WHERE "{owned[name]}" <= {cutoff}' if name in owned else ""
                conn.execute(text(f'INSERT INTO "{name}" ({names}) SELECT {", ".join(columns)} '
                                  f'FROM "{name}"{where}'))
    pad(db, mean_chars)
    with db.begin() as conn:
        if db.dialect.name == "postgresql":
            for name in [*CLONED, "runs", "policy_versions"]:
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                                  f"(SELECT max(id) FROM {name}))"))
            conn.execute(text("ANALYZE"))
        return int(conn.scalar(select(func.count()).select_from(EpisodeRow)))


def words(n: int = 5000, seed: int = 0) -> list[str]:
    """A vocabulary of `n` pronounceable words (a Zipf draw over it reads like a language to a
    trigram index: common trigrams, rare ones, and words sharing them)."""
    rng = random.Random(seed)
    onsets, vowels, codas = "b c d f g h k l m n p r s t v w z ch sh th".split(), "aeiou", "nrstlk"
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(["", *codas])
                        for _ in range(rng.randint(1, 3))))
    return sorted(out)


def pad(db: Engine, mean_chars: int, seed: int = 0) -> None:
    """Give every message its own text of about `mean_chars` characters after what it says
    (a real transcript's completions, tool outputs and prompts run to hundreds or thousands),
    and tag each assistant message with its episode (`ep<id>`)."""
    vocab = words()
    weights = [1 / (rank + 1) for rank in range(len(vocab))]
    rng = random.Random(seed)
    with db.begin() as conn:
        columns = (MessageRow.id, MessageRow.episode_id, MessageRow.role, MessageRow.content)
        rows = conn.execute(select(*columns)).all()
        updates = []
        for mid, eid, role, content in rows:
            filler = " ".join(rng.choices(vocab, weights, k=max(1, int(rng.expovariate(
                1 / (mean_chars / 6))))))
            tag = f" ep{eid}" if role == "assistant" else ""
            updates.append({"mid": mid, "content": f"{content} {filler}{tag}"})
        conn.execute(
            MessageRow.__table__.update().where(MessageRow.id == bindparam("mid"))
            .values(content=bindparam("content")), updates,
        )


def search_terms(db: Engine) -> list[str]:
    """Common and rare terms: the four most common words of three letters or more (in most
    messages), one of rank 100, the tags of the newest and a middle episode, `ep1` (the tags of
    episodes 1, 10-19, 100-199, 1000-1999: thousands of matches, none near the newest), and a
    word in no message."""
    with db.connect() as conn:
        last = conn.scalar(select(func.max(MessageRow.episode_id)).where(MessageRow.role == "assistant"))
    common = [w for w in words() if len(w) >= 3][:4]
    return [*common, words()[100], f"ep{last}", f"ep{last // 2}", "ep1", "quokka"]


def scan_ms(db: Engine, term: str, repeats: int) -> float:
    """The episode page for `term` the way the store found it before revision 0003: EXISTS +
    ILIKE over the messages, with no text index (PostgreSQL's is dropped for the measurement,
    in a transaction that is rolled back)."""
    query = (
        select(EpisodeRow.id).where(
            select(MessageRow.id).where(MessageRow.episode_id == EpisodeRow.id,
                                     MessageRow.content.ilike(f"%{term}%")).exists()
        ).order_by(EpisodeRow.id.desc()).limit(51)
    )
    with db.connect() as conn:
        if db.dialect.name == "postgresql":
            conn.execute(text(f"DROP INDEX {MESSAGE_SEARCH}_trgm"))
        try:
            return median_ms(lambda: conn.execute(query).all(), repeats)
        finally:
            conn.rollback()


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


@contextmanager
def live_api(url: str) -> Iterator[str]:
    app = create_app(Config(store={"url": url}))
    with EmbeddedServer.in_thread(app) as server:
        yield f"http://127.0.0.1:{server.port}"


def api_ms(url: str, terms: list[str], repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with live_api(url) as base, httpx.Client(base_url=base, timeout=60) as client:
        def get(path: str, **params: str) -> None:
            r = client.get(path, params=params)
            r.raise_for_status()

        for term in terms:
            out[f"q={term}"] = median_ms(lambda: get("/api/v1/episodes", q=term), repeats)
        out["list"] = median_ms(lambda: get("/api/v1/episodes"), repeats)
        out["stats"] = median_ms(lambda: get("/api/v1/stats"), repeats)
    return out


# What `episodes list` cannot avoid loading: the libraries the config, the store and the
# command line are built on, imported as the command imports them (no collection while they
# load, their heap frozen after: agent_rl/kernel/heap.py). Timed the same way, it is the floor the
# command is measured against.
LIBRARY_FLOOR = ("import gc; gc.disable(); "
                 "import sqlalchemy.orm, pydantic_settings, typer, anyio._backends._asyncio; "
                 "gc.freeze()")


def subprocess_s(cmd: list[str], env: dict[str, str], repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (user + system) of a command, after one
    warm-up run. CPU time says what the command costs when the machine is busy with other
    work, which stretches its wall time."""
    def once() -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    once()
    runs = [once() for _ in range(repeats)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def cli_s(url: str, *args: str, repeats: int) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AGENT_RL_") and k != "PYTHONDONTWRITEBYTECODE"}
    env["AGENT_RL_STORE__URL"] = url
    return subprocess_s([AGENT_RL, "episodes", "list", *args], env, repeats)


def backend(url: str, tokenizer_dir: Path, episodes: int, mean_chars: int,
            repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    anyio.run(template, url, tokenizer_dir)
    db = create_database(StoreConfig(url=url))
    try:
        n = clone_to(db, episodes, mean_chars)
        with db.connect() as conn:
            chars = conn.scalar(select(func.avg(func.length(MessageRow.content))))
        built = time.perf_counter() - t0
        terms = search_terms(db)
        api = api_ms(url, terms, repeats)
        scans = {term: scan_ms(db, term, max(3, repeats // 3)) for term in terms}
    finally:
        db.dispose()
    search = statistics.median([api[f"q={t}"] for t in terms])
    worst_term = max(terms, key=lambda t: api[f"q={t}"])
    worst = api[f"q={worst_term}"]
    scan = statistics.median(scans.values())
    name = "sqlite" if url.startswith("sqlite") else "postgres"
    print(f"{name:8s} {n} episodes (messages of {float(chars):.0f} characters on average) "
          f"built in {built:.1f} s")
    for t in terms:
        print(f"{name:8s} q={t:10s} API {api[f'q={t}']:7.1f} ms   old scan (query alone) "
              f"{scans[t]:7.1f} ms")
    print(f"{name:8s} q worst API {worst:.1f} ms (q={worst_term}), median over the terms "
          f"{search:.1f} ms vs scan {scan:.1f} ms: {scan / search:.1f}x; list {api['list']:.1f} "
          f"ms, stats {api['stats']:.1f} ms")
    return {"episodes": n, "search_ms": search, "worst_ms": worst, "scan_ms": scan,
            "stats_ms": api["stats"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--message-chars", type=int, default=600,
                        help="Mean length of the text added to each message.")
    args = parser.parse_args()
    from agent_rl.models import build_tokenizer

    os.environ.setdefault("AGENT_RL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        build_tokenizer().save_pretrained(tokenizer_dir)
        sqlite_url = f"sqlite:///{tmp}/store.db"
        sqlite = backend(sqlite_url, tokenizer_dir, args.episodes, args.message_chars,
                         args.repeats)
        cli_list, cli_list_cpu = cli_s(sqlite_url, repeats=7)
        cli_all, _ = cli_s(sqlite_url, "--limit", "10000", repeats=3)
        floor, floor_cpu = subprocess_s([sys.executable, "-c", LIBRARY_FLOOR], dict(os.environ), 7)
        print(f"cli      episodes list {cli_list:.2f} s ({cli_list_cpu:.2f} s CPU), --limit 10000 "
              f"{cli_all:.2f} s (SQLite, {sqlite['episodes']} episodes)")
        print(f"cli      importing its libraries alone ({LIBRARY_FLOOR}): {floor:.2f} s "
              f"({floor_cpu:.2f} s CPU)")
        with fresh_postgres() as pg_url:
            postgres = backend(pg_url, tokenizer_dir, args.episodes, args.message_chars,
                               args.repeats)
            pg_list, pg_list_cpu = cli_s(pg_url, repeats=7)
            print(f"cli      episodes list {pg_list:.2f} s ({pg_list_cpu:.2f} s CPU) (PostgreSQL, "
                  f"{postgres['episodes']} episodes)")
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}")
    result = {
        "cli_list_s": round(cli_list, 3),
        "cli_list_s_postgres": round(pg_list, 3),
        "q_worst_ms_sqlite": round(sqlite["worst_ms"], 2),
        "q_worst_ms_postgres": round(postgres["worst_ms"], 2),
        "q_median_ms_sqlite": round(sqlite["search_ms"], 2),
        "q_median_ms_postgres": round(postgres["search_ms"], 2),
        "stats_ms": round(max(sqlite["stats_ms"], postgres["stats_ms"]), 2),
        "cli_list_10000_s": round(cli_all, 3),
        "cli_list_cpu_s": round(cli_list_cpu, 3),
        "cli_list_cpu_s_postgres": round(pg_list_cpu, 3),
        "cli_library_floor_s": round(floor, 3),
        "cli_library_floor_cpu_s": round(floor_cpu, 3),
        "q_scan_over_search_sqlite": round(sqlite["scan_ms"] / sqlite["search_ms"], 2),
        "q_scan_over_search_postgres": round(postgres["scan_ms"] / postgres["search_ms"], 2),
        "episodes": min(sqlite["episodes"], postgres["episodes"]),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
