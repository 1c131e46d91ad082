"""The model families: found by `model_type`, each the only place its names appear in the code,
each preset made and read back by its own family (fast: configs only, no weights)."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from agent_rl import families
from agent_rl.kernel.errors import ConfigError
from agent_rl.models import PRESETS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent_rl", "trainer", "router", "envs", "tools_sandbox", "migrations")


def _names() -> set[str]:
    """Every name that is a family's: its model_type and the classes it is built as."""
    out: set[str] = set()
    for f in families.all_families():
        out |= {f.model_type, f.architecture, f.config_class}
        out |= {f.mtp_draft_architecture} - {None}
    return out


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, docstrings left out."""
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    # An attribute docstring (a string right after an assignment) is documentation too.
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr):
                    docs.add(id(after.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]  # fmt: skip


def test_no_code_outside_a_familys_home_names_a_family() -> None:
    names = _names()
    home = ROOT / "agent_rl" / "families"
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if home in path.parents:
                continue
            for node in _strings(ast.parse(path.read_text())):
                words = {node.value, *node.value.replace(",", " ").split()}
                if words & names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []
    # The check sees what it looks for: the family modules themselves are full of names.
    qwen2 = ast.parse((home / "qwen2.py").read_text())
    assert any(n.value == "qwen2" for n in _strings(qwen2))


def test_every_family_is_found_by_its_model_type_and_architecture() -> None:
    for model_type in families.FAMILIES:
        family = families.get(model_type)
        assert family.model_type == model_type
        assert families.by_architecture(family.architecture) is family
        assert family.draft in ("eagle", "mtp", None) and (
            (family.draft == "mtp") == (family.mtp_draft_architecture is not None))
    assert families.by_architecture("MistralForCausalLM") is None
    with pytest.raises(ConfigError, match=r"model_type 'mistral' is not supported; use one of"):
        families.get("mistral")


def _tiny_config(preset: str):  # noqa: ANN202 (a transformers config)
    p = PRESETS[preset]
    return families.get(p.architecture).tiny_config(p, dict(
        vocab_size=1024, hidden_size=p.hidden_size, num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim, intermediate_size=p.intermediate_size,
        max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_word_embeddings,
    ))  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_belongs_to_a_family_that_reads_its_config_back(
    preset: str, tmp_path: Path
) -> None:
    """The config a preset writes reads back through its family with the preset's shape."""
    p = PRESETS[preset]
    family = families.get(p.architecture)
    _tiny_config(preset).save_pretrained(tmp_path)
    arch = families.ModelArch.from_hf_dir(tmp_path)
    assert (arch.model_type, arch.num_layers, arch.hidden_size) == (
        family.model_type, p.num_hidden_layers, p.hidden_size)
    assert arch.tied_embeddings == p.tie_word_embeddings
    assert arch.rope_scaling_factor == p.options.get("rope_scaling_factor")
    assert arch.num_experts in (0, p.num_experts) and arch.has_draft == (family.draft is not None)


def _edited(model: Path, out: Path, **change: object) -> Path:
    out.mkdir()
    shutil.copy(model / "config.json", out / "config.json")
    config = json.loads((out / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_parameters": {"low_freq_factor": 2.0}}, "rope 'llama3' with"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "rope 'yarn' with"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"attention_bias": True}, "attention_bias=true"),
    ],
)
def test_llama_configs_it_cannot_map_are_refused_in_one_line(
    change: dict[str, object], message: str, tiny_llama_tied_model: Path, tmp_path: Path
) -> None:
    """From the variant with Llama 3's rope scaling (the preset has none), so that the edited
    rope is a `llama3` one."""
    bad = _edited(tiny_llama_tied_model, tmp_path / "bad", **change)
    with pytest.raises(ConfigError, match=message) as e:
        families.ModelArch.from_hf_dir(bad)
    assert "\n" not in str(e.value)


def test_llama_without_rope_scaling_reads_as_unscaled(
    tiny_llama_tied_model: Path, tmp_path: Path
) -> None:
    plain = _edited(tiny_llama_tied_model, tmp_path / "plain",
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    arch = families.ModelArch.from_hf_dir(plain)
    assert arch.rope_scaling_factor is None and arch.rope_theta == 500000.0
    assert families.get("llama").gpt_model_kwargs(arch) == {}


def test_a_preset_option_its_family_does_not_take_is_refused(tmp_path: Path) -> None:
    from agent_rl.models import init_model

    with pytest.raises(ValueError, match=r"qwen2 takes no options \['rope_scaling_factor'\]"):
        init_model(tmp_path / "m", "tiny-dense", options={"rope_scaling_factor": 8.0})


@pytest.mark.parametrize(
    "change,message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
        ({"n_group": 2, "topk_group": 1}, "n_group=2 .group-limited routing. is not supported"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace leaves no MoE layer"),
    ],
)
def test_glm4_moe_configs_it_cannot_map_are_refused_in_one_line(
    change: dict[str, object], message: str, tmp_path: Path
) -> None:
    _tiny_config("tiny-glm4-moe").save_pretrained(tmp_path / "ok")
    bad = _edited(tmp_path / "ok", tmp_path / "bad", **change)
    with pytest.raises(ConfigError, match=message) as e:
        families.ModelArch.from_hf_dir(bad)
    assert "\n" not in str(e.value)
