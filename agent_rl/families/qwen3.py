"""Qwen3 dense (`Qwen3ForCausalLM`): the standard decoder with a per-head RMSNorm on q and k.

Its MTP draft is SGLang's EAGLE one in the export's `draft/` only: SGLang's Qwen3 target would
load the draft's `layers.*` into its own layers and fails on names it does not know, so the
draft follows the policy under the in-memory syncs, not disk ones. No tiny preset (the tests
make one from tiny-dense's config).
"""

from __future__ import annotations

from agent_rl.families.base import Family


class Qwen3(Family):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    config_class = "Qwen3Config"
    qk_norm = True
