"""The tiny-model factory: deterministic, loadable by transformers, shaped for SGLang/Megatron."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from agent_rl.app.cli import app
from agent_rl.models import count_parameters, init_model


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = init_model(tmp_path / "a", "tiny-dense", seed=3, num_hidden_layers=1)
    b = init_model(tmp_path / "b", "tiny-dense", seed=3, num_hidden_layers=1)
    c = init_model(tmp_path / "c", "tiny-dense", seed=4, num_hidden_layers=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


@pytest.mark.parametrize("fixture", ["tiny_dense_model", "tiny_moe_model"])
def test_presets_load_in_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] % 128 == 0
    assert cfg["head_dim"] == 64 and cfg["rope_theta"] == 10000.0
    assert 1_000_000 < count_parameters(model_dir) < 10_000_000

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("Compute 12 + 7 with the calc tool.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    if fixture == "tiny_moe_model":
        assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2


def test_cli_model_init(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "init", str(tmp_path / "m"), "--preset", "tiny-moe", "--layers", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "tiny-moe model" in result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1

    bad = CliRunner().invoke(app, ["model", "init", str(tmp_path / "x"), "--preset", "huge"])
    assert bad.exit_code != 0 and "unknown preset" in bad.output
