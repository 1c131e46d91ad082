"""The quickstart's summary: the reward curve as a table and a PNG, the RL-vs-SFT test, the ledger."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agent_rl.app.evaluation import Evaluation, compare
from agent_rl.store import Audit

PLOT_FILE = "reward_curve.png"
RESULTS_FILE = "quickstart-results.json"
SIGNIFICANCE = 0.05


def summarize(
    evals: dict[str, Evaluation], training: list[dict[str, Any]], audit: Audit,
) -> dict[str, Any]:  # fmt: skip
    """Everything the report shows, as JSON-ready data (also written to RESULTS_FILE)."""
    out: dict[str, Any] = {
        "evals": {k: dict(v.as_dict(), mean=v.mean, stderr=v.stderr) for k, v in evals.items()},
        "training": [
            {"version": v["version"], "reward_mean": (v["metrics"] or {}).get("reward_mean"),
             "staleness_mean": (v["metrics"] or {}).get("staleness_mean"),
             "idle_fraction": (v["metrics"] or {}).get("idle_fraction")}
            for v in training
        ],  # fmt: skip
        "ledger": audit.ledger.as_dict(),
        "audit_problems": audit.problems(),
    }
    if "sft" in evals and "rl" in evals:
        out["rl_vs_sft"] = compare(evals["sft"], evals["rl"])
    if "base" in evals and "sft" in evals:
        out["sft_vs_base"] = compare(evals["base"], evals["sft"])
    return out


def print_report(console: Console, summary: dict[str, Any], plot: Path | None) -> None:
    table = Table(title="Reward on the fixed evaluation tasks (sampled; +- standard error)")
    for col in ("stage", "version", "mean reward", "tool use", "episodes"):
        table.add_column(col)
    names = {"base": "before SFT", "sft": "after SFT", "rl": "after RL"}
    for label, e in summary["evals"].items():
        table.add_row(names.get(label, label), "-" if e["version"] is None else f"v{e['version']}",
                      f"{e['mean']:.3f} +- {e['stderr']:.3f}", f"{e['tool_use']:.0%}",
                      f"{e['episodes']} ({e['failed']} failed)")  # fmt: skip
    console.print(table)
    test = summary.get("rl_vs_sft")
    if test is not None:
        verdict = ("RL improved on SFT" if test["p_value"] < SIGNIFICANCE and test["gain"] > 0
                   else "no significant RL gain over SFT")
        console.print(f"{verdict}: {test['gain']:+.3f} mean reward over {int(test['tasks'])} tasks, "
                      f"one-sided Wilcoxon p = {test['p_value']:.2g}", highlight=False)
    if plot is not None:
        console.print(f"reward curve: {plot}")
    ledger = summary["ledger"]
    console.print("ledger: " + ", ".join(f"{k} {v}" for k, v in ledger.items()), highlight=False)
    problems = summary["audit_problems"]
    console.print("audit: " + ("every episode accounted for, in one recorded state; none trained twice"
                               if not problems else "; ".join(problems)), highlight=False)


def write_plot(summary: dict[str, Any], path: Path) -> Path:
    """Two panels: the evaluations (before SFT, after SFT, after RL) and the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = {"base": "before SFT", "sft": "after SFT", "rl": "after RL"}
    evals = summary["evals"]
    xs = list(range(len(evals)))
    left.errorbar(xs, [e["mean"] for e in evals.values()],
                  yerr=[0 if math.isnan(e["stderr"]) else 1.96 * e["stderr"] for e in evals.values()],
                  marker="o", capsize=4)  # fmt: skip
    left.set_xticks(xs, [names.get(k, k) for k in evals])
    left.set_ylabel("mean reward (fixed eval tasks, 95% CI)")
    left.set_ylim(0, 1)
    left.set_title("evaluation")
    points = [(t["version"], t["reward_mean"]) for t in summary["training"] if t["reward_mean"] is not None]
    if points:
        right.plot([p[0] for p in points], [p[1] for p in points], marker=".")
    right.set_xlabel("policy version (RL step)")
    right.set_ylabel("mean reward of the step's batch")
    right.set_ylim(0, 1)
    right.set_title("RL training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_results(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=1, default=str))
