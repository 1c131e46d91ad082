"""Model families, one module each, found by HF `model_type` (registry.py).

Everything true of a family lives in its module (base.py says what that is); nothing else in
agent-rl branches on a family's name. Adding a family is its module plus one registry line.
"""

from __future__ import annotations

from agent_rl.families.arch import ModelArch
from agent_rl.families.base import Family
from agent_rl.families.registry import FAMILIES, all_families, by_architecture, get

__all__ = ["FAMILIES", "Family", "ModelArch", "all_families", "by_architecture", "get"]
