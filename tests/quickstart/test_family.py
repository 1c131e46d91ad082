"""`agent-rl quickstart --family`: another family's tiny preset at the quickstart model's size,
an MoE one with its engines returning routed experts (R3); a family without a preset is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agent_rl.app.quickstart.recipe import MODEL_PRESET, Options, base_model, write_or_load
from agent_rl.families.arch import ModelArch
from agent_rl.models import PRESETS, init_model


def test_a_family_s_preset_takes_the_quickstart_model_s_size() -> None:
    assert base_model(None) == (MODEL_PRESET, {})
    preset, size = base_model("glm4_moe")
    assert PRESETS[preset].architecture == "glm4_moe"
    quick = PRESETS[MODEL_PRESET]
    assert size["hidden_size"] == quick.hidden_size and size["intermediate_size"] == quick.intermediate_size
    assert size["num_attention_heads"] * size["head_dim"] == size["hidden_size"]  # SGLang's CPU KV cache


def test_a_family_without_a_preset_is_refused_naming_those_with_one() -> None:
    with pytest.raises(ValidationError, match="no tiny preset of that family; one of .*llama"):
        Options(family="qwen3")


def test_an_moe_family_s_engines_return_routed_experts(tmp_path: Path) -> None:
    preset, size = base_model("glm4_moe")
    model = init_model(tmp_path / "model", preset, **size)
    arch = ModelArch.from_hf_dir(model)
    assert arch.is_moe and arch.hidden_size == PRESETS[MODEL_PRESET].hidden_size
    cfg = write_or_load(tmp_path / "run", Options(family="glm4_moe"), moe=arch.is_moe)
    assert cfg.engine.moe_routing_replay
    assert not write_or_load(tmp_path / "dense", Options()).engine.moe_routing_replay
