"""The quickstart, shortened, as CI's end-to-end test of the whole system.

Real pieces throughout: `agent-rl quickstart` as a user runs it (a subprocess), which starts a
real SGLang engine and the router as processes, SFT-trains with Megatron-core, then runs `agent-rl
serve` and `agent-rl train` together against a SQLite store, and evaluates at pinned weights.
Asserted: RL beat SFT on the fixed evaluation tasks by a significant margin (one-sided Wilcoxon
over tasks), the RL evaluation ran at the final policy version, the ledger balances with every
episode in one recorded state and none trained twice; and a second run resumes (reports the same
results without redoing any stage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.quickstart.conftest import SharedSFT

# A whole run: one fleet of processes at a time (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.one_at_a_time("fleet")]

# Shortened from the defaults (CI time): half the SFT steps (the loss is flat after ~200) and 40
# RL versions. Measured at load 7-15: SFT 0.285, RL 0.660, gain +0.375, p = 5e-10 (against
# +0.469 at 400 SFT and 60 RL steps), so the margin holds with room to spare.
ARGS = ["--sft-steps", "200", "--rl-steps", "40", "--rl-minutes", "6", "--eval-tasks", "64",
        "--eval-samples", "4", "--no-serve-after"]


def _quickstart(workdir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    return subprocess.run(
        [sys.executable, "-m", "agent_rl.app.cli", "quickstart", "--workdir", str(workdir), *ARGS],
        env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def test_quickstart_rl_beats_sft_and_the_ledger_balances(
    engine_venv: Path, tmp_path: Path, shared_sft: SharedSFT
) -> None:
    workdir = tmp_path / "qs"
    done = _quickstart(workdir, timeout_s=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((workdir / "quickstart-results.json").read_text())
    evals = results["evals"]
    assert set(evals) == {"base", "sft", "rl"}
    state = json.loads((workdir / "quickstart.json").read_text())
    # Pinned: the RL evaluation ran on the export of the final policy version.
    assert evals["rl"]["version"] == state["rl_version"] >= 10
    assert evals["rl"]["weights"].endswith(f"v{state['rl_version']:06d}")
    assert evals["sft"]["version"] == 0
    for e in evals.values():
        assert e["episodes"] == 64 * 4 and e["failed"] == 0
    test = results["rl_vs_sft"]
    assert test["gain"] > 0.05 and test["p_value"] < 0.01, results
    assert results["audit_problems"] == []
    ledger = results["ledger"]
    assert ledger["trained"] >= 10 * 8 * 8 // 2  # steps x groups x samples (some groups filtered)
    assert ledger["admitted"] == ledger["trained"] + ledger["filtered"] + ledger["failed"] + ledger["in_flight"]
    assert ledger["running"] == ledger["waiting"] == 0
    assert (workdir / "reward_curve.png").stat().st_size > 10_000
    assert "RL improved on SFT" in done.stdout
    shared_sft.keep(workdir, sft_steps=int(ARGS[ARGS.index("--sft-steps") + 1]))

    # A second run resumes: every stage is recorded as done, so it only reports.
    t0 = time.monotonic()
    again = _quickstart(workdir, timeout_s=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((workdir / "quickstart-results.json").read_text())["evals"] == evals
    assert "SFT warm start" not in again.stdout and "evaluating" not in again.stdout
    assert time.monotonic() - t0 < 300
