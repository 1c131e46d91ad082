"""What one CPU engine start and stop cost: wall seconds to /health_generate, CPU seconds over the
engine's whole process group (the server, SGLang's scheduler and detokenizer, and whatever else
it spawned), and wall seconds for `stop()`.

The test suite starts dozens of engines, so their start is much of its CPU. This starts
`--starts` engines one after another on a tiny preset (`agent-rl model init`), each through
`EngineServer`, sends one /generate once healthy, reads every process of its group's CPU time
(user + system, with reaped children) from /proc just before stopping it, and reports the
medians. Usage: python bench/engine_start.py [--preset tiny-moe] [--starts 3]
Last line: RESULT {"healthy_s": ..., "cpu_s": ..., "cpu_s_by_process": {...}, "stop_s": ...,
"load_average": [...]}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_rl.config import load_config  # noqa: E402
from agent_rl.engine.launcher import EngineServer  # noqa: E402
from agent_rl.models import init_model  # noqa: E402
from bench._proc import group_cpu_s  # noqa: E402

def one_start(model: Path, venv: Path, log_dir: Path) -> dict:
    server = EngineServer(model, venv=venv, log_dir=log_dir, device="cpu")
    t0 = time.monotonic()
    server.start()
    healthy_s = time.monotonic() - t0
    try:
        r = httpx.post(server.url + "/generate", timeout=60, json={
            "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        r.raise_for_status()
        assert server.pid is not None
        cpu = group_cpu_s(server.pid)
    finally:
        t1 = time.monotonic()
        server.stop()
    return {"healthy_s": healthy_s, "cpu": cpu, "stop_s": time.monotonic() - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--starts", type=int, default=3)
    args = ap.parse_args()
    venv = load_config().engine.venv
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / args.preset, args.preset, seed=0)
        runs = []
        for _ in range(args.starts):
            run = one_start(model, venv, Path(tmp) / "logs")
            print(json.dumps(run), flush=True)
            runs.append(run)
    by_name: dict[str, list[float]] = {}
    for run in runs:
        summed: dict[str, float] = {}
        for key, seconds in run["cpu"].items():  # the server and its resource tracker: "python"
            name = key.rsplit(":", 1)[0]
            summed[name] = summed.get(name, 0.0) + seconds
        for name, seconds in summed.items():
            by_name.setdefault(name, []).append(seconds)
    print("RESULT " + json.dumps({
        "healthy_s": round(statistics.median(r["healthy_s"] for r in runs), 2),
        "cpu_s": round(statistics.median(sum(r["cpu"].values()) for r in runs), 2),
        "cpu_s_by_process": {k: round(statistics.median(v), 2) for k, v in by_name.items()},
        "stop_s": round(statistics.median(r["stop_s"] for r in runs), 2),
        "load_average": [float(x) for x in open("/proc/loadavg").read().split()[:3]],
    }))


if __name__ == "__main__":
    main()
