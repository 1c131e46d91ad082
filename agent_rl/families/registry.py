"""The model families, found by HF `model_type`: one line each.

Each entry names the family's class (`module:Class`, as Gymnasium's `register` names an entry
point) rather than importing it, so the registry stays below every family module (a family's
`ModelArch.from_hf_dir` asks it) and loads a family only when asked.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from agent_rl.kernel.errors import ConfigError

FAMILIES: dict[str, str] = {
    "qwen2": "agent_rl.families.qwen2:Qwen2",
    "qwen3": "agent_rl.families.qwen3:Qwen3",
    "qwen3_moe": "agent_rl.families.qwen3_moe:Qwen3Moe",
    "llama": "agent_rl.families.llama:Llama",
    "glm4_moe": "agent_rl.families.glm4_moe:Glm4Moe",
    "deepseek_v3": "agent_rl.families.deepseek_v3:DeepseekV3",
}
"""HF `model_type` -> the family's class (an `agent_rl.families.base.Family`)."""


def get(model_type: str, where: str = "") -> Any:
    """The family (a `Family` instance) of `model_type`; ConfigError, prefixed with `where`,
    for one we cannot map."""
    entry = FAMILIES.get(model_type)
    if entry is None:
        raise ConfigError(
            f"{where}model_type {model_type!r} is not supported; use one of {tuple(FAMILIES)}"
        )
    return _load(entry)


@cache
def _load(entry: str) -> Any:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)()


def all_families() -> list[Any]:
    """Every registered family, in the registry's order."""
    return [get(kind) for kind in FAMILIES]


def by_architecture(architecture: str) -> Any | None:
    """The family transformers and SGLang build as `architecture` (config.json's
    `architectures[0]`); None for one no family is."""
    return next((f for f in all_families() if f.architecture == architecture), None)
