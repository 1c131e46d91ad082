"""Tiny random-init models and their tokenizer, made locally (no downloads)."""

from __future__ import annotations

from agent_rl.models.tiny import PRESETS, ModelPreset, count_parameters, init_model
from agent_rl.models.tokenizer import build_tokenizer, chat_template

__all__ = ["PRESETS", "ModelPreset", "build_tokenizer", "chat_template", "count_parameters", "init_model"]
