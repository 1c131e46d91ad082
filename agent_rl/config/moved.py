"""Keys that moved, and the one-line error that names where each went.

When a section is nested or a key renamed, its old spelling goes in a table here (old key ->
what to write instead, both relative to the section) and the section's `before` validator
refuses any old key given in the TOML file, the environment (`AGENT_RL_TRAINER__LR`) or an
override, with the new key in the message: a config that silently kept a default because a
key moved would not tell the truth.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

TRAINER_MOVED: dict[str, str] = {
    "lr": "optim.lr",
    "lr_warmup_steps": "optim.lr_warmup_steps",
    "adam_beta1": "optim.beta1",
    "adam_beta2": "optim.beta2",
    "adam_eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
    "grad_clip": "optim.grad_clip",
    "loss_type": 'loss.policy_loss ("ppo" is now "grpo")',
    "advantage_std_normalize": 'loss.advantage = "grpo" (true) or "dr_grpo" (false)',
    "clip_eps_low": "loss.clip_eps_low",
    "clip_eps_high": "loss.clip_eps_high",
    "tis_cap": "loss.tis_cap",
    "kl_coef": "loss.kl_coef",
    "aggregation": "loss.aggregation",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "distributed_optimizer": "parallel.distributed_optimizer",
    "mtp_layers": "mtp.layers",
    "mtp_ffn_hidden_size": "mtp.ffn_hidden_size",
    "mtp_num_attention_heads": "mtp.num_attention_heads",
    "mtp_loss_coef": "mtp.loss_coef",
    "mtp_objective": "mtp.objective",
    "mtp_lr": "mtp.lr",
    "mtp_detach": "mtp.detach",
    "mtp_train": "mtp.train",
    "eval_every": "eval.every",
    "eval_tasks": "eval.tasks",
    "eval_samples": "eval.samples",
    "eval_env": "eval.env",
    "eval_split": "eval.split",
    "eval_seed": "eval.seed",
    "eval_nice": "eval.nice",
    "eval_cpu_idle": "eval.cpu_idle",
    "eval_router_url": "eval.router_url",
    "sft_lr": "sft.lr",
    "sft_steps": "sft.steps",
    "sft_batch_size": "sft.batch_size",
    "sft_demos": "sft.demos",
    "router_url": "weight_sync.router_url",
    "weight_sync": "weight_sync.mode",
    "weight_sync_bucket_mb": "weight_sync.bucket_mb",
    "weight_sync_timeout_s": "weight_sync.timeout_s",
    "weight_sync_host": "weight_sync.host",
}
"""`[trainer]`'s flat keys before its sections (optim, loss, parallel, mtp, eval, sft,
weight_sync), and where each lives now."""

# Keys that are a section now: old only when given a plain value (`weight_sync = "tensor"`).
_NOW_SECTIONS = {"weight_sync"}


def moved_keys(section: str, data: Any, table: dict[str, str]) -> None:
    """Raise a pydantic error naming every old key of `table` found in `data` and its new key.

    The error's type is `moved_key`, which `load_config` reports as the message alone."""
    if not isinstance(data, dict):
        return
    found = [old for old in data if old in table
             and not (old in _NOW_SECTIONS and isinstance(data[old], (dict, BaseModel)))]
    if found:
        raise PydanticCustomError("moved_key", "; ".join(
            f"{section}.{old} moved: write {section}.{table[old]}" for old in found))


def moved_in_environment(environ: dict[str, str], prefix: str = "AGENT_RL_") -> str | None:
    """The moved-key message for an `AGENT_RL_TRAINER__<OLD>` variable, or None.

    The validator above sees most of them; a variable naming a key that is a section now
    (`AGENT_RL_TRAINER__WEIGHT_SYNC=tensor`) fails earlier, in pydantic-settings' parsing of
    the section, and is named here instead."""
    head = f"{prefix}TRAINER__".lower()
    for name in environ:
        old = name.lower().removeprefix(head)
        if name.lower().startswith(head) and old in TRAINER_MOVED:
            return f"trainer.{old} moved: write trainer.{TRAINER_MOVED[old]}"
    return None
