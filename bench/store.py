"""Store write throughput vs raw inserts of the same bytes, and claim+commit latency.

Side by side in one run, on SQLite (a temp file) and PostgreSQL (a throwaway database on
AGENT_RL_TEST_POSTGRES_URL, default the local test server):
- our store writing complete 32k-token episodes durably through its public API as `serve` does:
  admit a group of 8, then per episode start and one final turn (ids + logprobs + mask +
  versions, with the reward); then complete the group; vs
- the raw floor: SQLite `INSERT` of the same four blobs, one committed row per episode, with the
  same pragmas (WAL, synchronous=FULL); PostgreSQL `COPY` of the same bytes, one committed COPY
  per episode.
- `claim` + `commit` of a 256-episode batch (32 groups of 8).
Last line: RESULT {"sqlite_ratio", "postgres_ratio", "claim_commit_ms"} (claim_commit_ms is
the worse of the two backends).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import StoreConfig  # noqa: E402
from agent_rl.kernel.encoding import NO_VERSION  # noqa: E402
from agent_rl.store import Store, TokenArrays, TurnRecord  # noqa: E402
from agent_rl.store.migrate import upgrade  # noqa: E402
from tests._databases import fresh_postgres  # noqa: E402

TOKENS = 32_768
GROUP = 8


def episode_arrays(seed: int) -> TokenArrays:
    rng = np.random.default_rng(seed)
    mask = (rng.random(TOKENS) < 0.7).astype(np.uint8)
    return TokenArrays.build(
        token_ids=rng.integers(0, 150_000, TOKENS),
        logprobs=np.where(mask == 1, -rng.random(TOKENS), 0.0),
        loss_mask=mask,
        versions=np.where(mask == 1, 3, NO_VERSION),
    )


async def store_rate(url: str, episodes: list[TokenArrays]) -> float:
    cfg = StoreConfig(url=url)
    await upgrade(cfg)
    async with await Store.open(cfg) as store:
        run = await store.ensure_run("bench")
        task = await store.add_task(run, "bench", "0", {})
        t0 = time.perf_counter()
        for start in range(0, len(episodes), GROUP):
            batch = episodes[start : start + GROUP]
            group, ids = await store.admit_group(run, task, "bench", len(batch))
            for episode, tokens in zip(ids, batch):
                await store.start_episode(episode, "bench")
                now = time.time()
                # The last turn and the reward land in one durable commit, as the runner does.
                await store.append_turn(
                    episode, TurnRecord(tokens=tokens, num_prompt_tokens=0, started_at=now, finished_at=now),
                    final_reward=1.0,
                )
            await store.complete_group(group)
        return len(episodes) / (time.perf_counter() - t0)


def sqlite_raw_rate(path: str, episodes: list[TokenArrays]) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE raw (id INTEGER PRIMARY KEY, ids BLOB, lp BLOB, mask BLOB, ver BLOB)")
    t0 = time.perf_counter()
    for a in episodes:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO raw (ids, lp, mask, ver) VALUES (?, ?, ?, ?)",
            (a.token_ids.tobytes(), a.logprobs.tobytes(), a.loss_mask.tobytes(), a.versions.tobytes()),
        )
        conn.execute("COMMIT")
    rate = len(episodes) / (time.perf_counter() - t0)
    conn.close()
    return rate


def postgres_copy_rate(url: str, episodes: list[TokenArrays]) -> float:
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE raw (id serial PRIMARY KEY, ids bytea, lp bytea, mask bytea, ver bytea)")
        conn.commit()
        t0 = time.perf_counter()
        for a in episodes:
            with conn.cursor().copy("COPY raw (ids, lp, mask, ver) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(["bytea"] * 4)
                copy.write_row(
                    (a.token_ids.tobytes(), a.logprobs.tobytes(), a.loss_mask.tobytes(), a.versions.tobytes())
                )
            conn.commit()
        return len(episodes) / (time.perf_counter() - t0)


async def claim_commit_ms(url: str, repeats: int = 5) -> float:
    async with await Store.open(StoreConfig(url=url)) as store:
        run = await store.ensure_run("claims")
        task = await store.add_task(run, "bench", "0", {})
        tokens = TokenArrays.build(np.arange(64), np.zeros(64), np.ones(64), np.zeros(64))
        timings = []
        for rep in range(repeats):
            for _ in range(32):
                group, episodes = await store.admit_group(run, task, "bench", 8)
                for e in episodes:
                    await store.start_episode(e, "bench")
                    await store.append_turn(e, TurnRecord(tokens=tokens, num_prompt_tokens=0,
                                                          started_at=0.0, finished_at=0.0))
                    await store.finish_episode(e, 1.0)
                await store.complete_group(group)
            t0 = time.perf_counter()
            claim = await store.claim(run, "bench", 32)
            await store.commit(claim, run, step=rep + 1, version=rep + 1,
                               advantages={e: 0.1 for e in claim.episode_ids})
            timings.append((time.perf_counter() - t0) * 1000)
            assert len(claim.episode_ids) == 256
        return float(np.median(timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    episodes = [episode_arrays(i) for i in range(args.episodes)]
    mb = sum(a.token_ids.nbytes + a.logprobs.nbytes + a.loss_mask.nbytes + a.versions.nbytes
             for a in episodes) / 2**20
    print(f"{args.episodes} episodes of {TOKENS} tokens, {mb:.1f} MiB of token arrays")

    with tempfile.TemporaryDirectory() as tmp:
        raw = sqlite_raw_rate(os.path.join(tmp, "raw.db"), episodes)
        ours = anyio.run(store_rate, f"sqlite:///{tmp}/store.db", episodes)
        sqlite_cc = anyio.run(claim_commit_ms, f"sqlite:///{tmp}/store.db")
    print(f"sqlite   raw INSERT {raw:8.1f} ep/s   store {ours:8.1f} ep/s   ratio {ours / raw:.2f}   "
          f"claim+commit(256) {sqlite_cc:.1f} ms")
    sqlite_ratio = ours / raw

    os.environ.setdefault("AGENT_RL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    with fresh_postgres() as url:
        raw_pg = postgres_copy_rate(url, episodes)
    with fresh_postgres() as url:
        ours_pg = anyio.run(store_rate, url, episodes)
        pg_cc = anyio.run(claim_commit_ms, url)
    print(f"postgres COPY       {raw_pg:8.1f} ep/s   store {ours_pg:8.1f} ep/s   ratio {ours_pg / raw_pg:.2f}   "
          f"claim+commit(256) {pg_cc:.1f} ms")

    result = {
        "sqlite_ratio": round(sqlite_ratio, 3),
        "postgres_ratio": round(ours_pg / raw_pg, 3),
        "claim_commit_ms": round(max(sqlite_cc, pg_cc), 2),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
