"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the standard decoder with a bias on q/k/v.

Its MTP draft is SGLang's EAGLE one (`Qwen2ForCausalLMEagle`, in the export's `draft/`), also
carried beside the target's weights: SGLang's Qwen2 target skips names it does not know, so a
disk update reaches the draft too. Presets: `tiny-dense` and `quickstart`.
"""

from __future__ import annotations

from typing import ClassVar

from agent_rl.families.base import Family


class Qwen2(Family):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    config_class = "Qwen2Config"
    qkv_bias = True
    eagle_beside_target = True
    presets: ClassVar = {
        "tiny-dense": {},
        # The quickstart's model: about 3x less compute per token than tiny-dense, small enough
        # to learn the calculator task (SFT, then RL) on two CPU cores in minutes. SGLang's CPU
        # path sizes its KV cache by hidden_size / heads, so heads x head_dim must equal
        # hidden_size.
        "quickstart": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "intermediate_size": 384},
    }  # fmt: skip
