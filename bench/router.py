"""Router overhead, side by side in one run: direct vs the agent-rl router vs smg (Rust gateway).

A stub engine answers `/generate` after 50 ms with a ~1 KB SGLang-shaped body. A closed-loop load
generator (its own process) sends the same request at concurrency 1 and 256 straight to the stub,
through `agent-rl router` (started with its CLI, one worker), and through `smg launch` when the
`smg` package is installed (`pip install -e '.[bench]'`). Rounds are interleaved and the order of
targets rotates, so the machine's background load falls on all three alike; each figure is the
median over rounds. The router's and smg's CPU time per request is reported beside latency.

Last line: RESULT {"p50_ratio", "p99_ratio", "throughput_ratio"} (ours over direct at
concurrency 256) and "smg_p50_ratio" (ours over smg at 256; null when smg cannot run, with the
reason printed above). Targets: p50 <= 1.05, p99 <= 1.10, throughput >= 0.95, smg ratio <= 1.

    python bench/router.py [--rounds 3] [--requests 3000] [--requests-c1 100]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._proc import cpu_s  # noqa: E402

STUB_DELAY_S = 0.05
STUB_BODY = json.dumps({"text": "x" * 900, "output_ids": list(range(64)),
                        "meta_info": {"completion_tokens": 64, "weight_version": "v0"}}).encode()
REQUEST = json.dumps({"text": "hello " * 200, "sampling_params": {"max_new_tokens": 64}}).encode()


# -- roles run in their own processes -------------------------------------------------------

def run_stub(port: int) -> None:
    """The stub engine: /generate after 50 ms; the few GETs a gateway probes at start."""
    import uvloop
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(STUB_DELAY_S)
        return web.Response(body=STUB_BODY, content_type="application/json")

    async def other(request: web.Request) -> web.Response:
        if request.path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            return web.json_response({"model_path": "stub", "is_generation": True,
                                      "weight_version": "v0", "dp_size": 1, "tp_size": 1})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_route("*", "/{tail:.*}", other)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None,
                loop=uvloop.new_event_loop(), backlog=2048)


def run_load(url: str, n: int, concurrency: int) -> None:
    """Closed-loop load: n requests at a fixed concurrency; prints p50/p99 (ms) and req/s."""
    import aiohttp
    import numpy as np
    import uvloop

    async def main() -> dict[str, float]:
        latencies: list[float] = []
        gate = asyncio.Semaphore(concurrency)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def one(record: bool) -> None:
                async with gate:
                    t = time.perf_counter()
                    async with session.post(url + "/generate", data=REQUEST,
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    if record:
                        latencies.append((time.perf_counter() - t) * 1000)

            await asyncio.gather(*(one(False) for _ in range(min(n, 2 * concurrency + 20))))
            t0 = time.perf_counter()
            await asyncio.gather(*(one(True) for _ in range(n)))
            elapsed = time.perf_counter() - t0
        a = np.array(latencies)
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                "rps": n / elapsed}

    print(json.dumps(uvloop.run(main())))


# -- orchestration --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, probe: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe == "generate":
                req = urllib.request.Request(url + "/generate", data=REQUEST, method="POST",
                                             headers={"Content-Type": "application/json"})
            else:
                req = urllib.request.Request(url + probe)
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def measure(url: str, n: int, c: int, pid: int | None) -> dict[str, float]:
    before = cpu_s(pid) if pid else 0.0
    out = subprocess.run([sys.executable, __file__, "--role", "load", "--url", url,
                          "--n", str(n), "--c", str(c)],
                         capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if pid:
        # Includes warm-up requests: an upper bound on the proxy's CPU cost per request.
        warm = min(n, 2 * c + 20)
        result["cpu_ms_per_req"] = (cpu_s(pid) - before) * 1000 / (n + warm)
    return result


def start_smg(stub: str) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    if importlib.util.find_spec("smg") is None:
        return None, "", "smg is not installed (pip install -e '.[bench]')"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "smg.launch_router", "--worker-urls", stub, "--host", "127.0.0.1",
         "--port", str(port), "--policy", "round_robin", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    if not wait_ready(url, "generate", 60):
        proc.kill()
        return None, "", "smg did not answer /generate within 60 s"
    return proc, url, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["main", "stub", "load"], default="main")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--url", default="")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--c", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000, help="requests per run at concurrency 256")
    ap.add_argument("--requests-c1", type=int, default=100, help="requests per run at concurrency 1")
    args = ap.parse_args()
    if args.role == "stub":
        return run_stub(args.port)
    if args.role == "load":
        return run_load(args.url, args.n, args.c)

    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub_port = free_port()
        stub = f"http://127.0.0.1:{stub_port}"
        procs.append(subprocess.Popen([sys.executable, __file__, "--role", "stub", "--port", str(stub_port)]))
        assert wait_ready(stub, "/health"), "stub engine did not start"
        ours_port = free_port()
        ours = f"http://127.0.0.1:{ours_port}"
        env = dict(os.environ, AGENT_RL_ROUTER__ADMIN_TOKEN="bench")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from agent_rl.app.cli import main; main()", "router",
             "--port", str(ours_port), "--worker", stub],
            env=env, stderr=subprocess.DEVNULL))
        assert wait_ready(ours, "/health"), "agent-rl router did not start"
        targets: dict[str, tuple[str, int | None]] = {"direct": (stub, None), "ours": (ours, procs[-1].pid)}
        smg_proc, smg_url, smg_why = start_smg(stub)
        if smg_proc is not None:
            procs.append(smg_proc)
            targets["smg"] = (smg_url, smg_proc.pid)
        else:
            print(f"smg: not measured: {smg_why}")

        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        names = list(targets)
        for r in range(args.rounds):
            for c, n in ((1, args.requests_c1), (256, args.requests)):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    url, pid = targets[name]
                    res = measure(url, n, c, pid)
                    runs.setdefault((name, c), []).append(res)
                    print(f"round {r} c={c:<3} {name:<6} " + " ".join(f"{k}={v:.2f}" for k, v in res.items()),
                          flush=True)

        med = {key: {m: statistics.median(x[m] for x in rs) for m in rs[0]} for key, rs in runs.items()}
        print(f"\nmedian of {args.rounds} rounds, stub answering after {STUB_DELAY_S * 1000:.0f} ms")
        print(f"{'target':<8}{'c':>5}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'cpu ms/req':>12}")
        for (name, c), m in sorted(med.items(), key=lambda kv: (kv[0][1], names.index(kv[0][0]))):
            print(f"{name:<8}{c:>5}{m['p50']:>10.1f}{m['p99']:>10.1f}{m['rps']:>10.0f}"
                  f"{m.get('cpu_ms_per_req', float('nan')):>12.3f}")
        d, o = med[("direct", 256)], med[("ours", 256)]
        d1, o1 = med[("direct", 1)], med[("ours", 1)]
        print(f"concurrency 1: ours adds {o1['p50'] - d1['p50']:.2f} ms at p50 over direct")
        result: dict[str, Any] = {
            "p50_ratio": round(o["p50"] / d["p50"], 3),
            "p99_ratio": round(o["p99"] / d["p99"], 3),
            "throughput_ratio": round(o["rps"] / d["rps"], 3),
            "smg_p50_ratio": round(o["p50"] / med[("smg", 256)]["p50"], 3) if "smg" in targets else None,
        }
        print("RESULT " + json.dumps(result))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
