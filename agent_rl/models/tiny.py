"""The tiny-model factory: random-init HF model directories that SGLang and transformers load.

No model can be downloaded on a CI machine, so agent-rl makes its own. `init_model(out, preset)`
writes `config.json`, `generation_config.json`, `model.safetensors` and the tokenizer files
(with the chat template) into `out`:

- `tiny-dense`: a Qwen2 decoder (`Qwen2ForCausalLM`), ~3M parameters.
- `tiny-moe`: a Qwen3-MoE decoder (`Qwen3MoeForCausalLM`), 8 experts, top-2, ~3M parameters.
- `tiny-llama`: a Llama 3-shaped decoder (`LlamaForCausalLM`, untied embeddings like Llama
  3.1 8B, default rope; tied embeddings and llama3 rope scaling by overrides), ~2.9M parameters.
- `tiny-glm4-moe`: a GLM-4.5-shaped MoE (`Glm4MoeForCausalLM`: a dense first layer, 8 experts,
  top-2, a shared expert, sigmoid router), ~3.3M parameters.
Each preset belongs to its family (agent_rl.families), which makes the transformers config.

Shapes follow what the rest of the stack needs: head dim 64 (SGLang's CPU attention and
Megatron's fused paths), a vocabulary padded to a multiple of 128 (Megatron's tensor-parallel
split), and `rope_theta` written at the top level of config.json beside transformers 5's
`rope_parameters` (older readers, including the Megatron converter, look there).
The same preset, overrides and seed give byte-identical weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from agent_rl import families
from agent_rl.models.presets import PRESETS, VOCAB_MULTIPLE, ModelPreset, PresetName
from agent_rl.models.tokenizer import build_tokenizer

__all__ = ["PRESETS", "ModelPreset", "count_parameters", "init_model", "padded_vocab"]


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return (n + multiple - 1) // multiple * multiple


def _hf_config(p: ModelPreset, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_word_embeddings,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=pad_id,
        dtype="float32",
    )
    return families.get(p.architecture).tiny_config(p, common)


def init_model(
    out: Path | str, preset: PresetName | str = "tiny-dense", seed: int = 0, **overrides: Any
) -> Path:
    """Write a random-init model directory for `preset` (fields overridable) and return it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset].model_copy(update=overrides)
    p = ModelPreset.model_validate(p.model_dump())  # re-validate the overridden fields
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(p.tokenizer_vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = _hf_config(p, padded_vocab(len(tokenizer)), eos_id, pad_id)

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = families.get(p.architecture).model_class()(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = p.rope_theta
    families.get(p.architecture).tiny_config_json(p, cfg)
    cfg["agent_rl_preset"] = preset
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def count_parameters(model_dir: Path | str) -> int:
    """Number of parameters stored in a model directory's safetensors file(s)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                total += math.prod(st.get_slice(name).get_shape())
    return total
