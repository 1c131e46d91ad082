"""Tiny random-init models and their tokenizer, made locally (no downloads).

`init_model`, `build_tokenizer`, `chat_template` and `count_parameters` are imported lazily:
`PRESETS` alone (e.g. for CLI help) does not load torch or transformers.
"""

from __future__ import annotations

from typing import Any

from agent_rl.models.presets import PRESETS, ModelPreset

_LAZY = {
    "init_model": "agent_rl.models.tiny",
    "count_parameters": "agent_rl.models.tiny",
    "build_tokenizer": "agent_rl.models.tokenizer",
    "chat_template": "agent_rl.models.tokenizer",
}

__all__ = ["PRESETS", "ModelPreset", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agent_rl.models' has no attribute {name!r}")
