"""`trainer.mtp.layers`: megatron-core MTP draft modules trained on every step with the policy
(real megatron-core on CPU, one process). Detached (the default), the draft learns and the
policy's weights are bit-for-bit those of a run without MTP; joint, the MTP loss moves the
policy too. Packed and padded micro-batches give the same MTP loss; checkpoints resume the
draft exactly; an export carries it as `mtp.*` and loads back bit-exact, and SGLang's own
Qwen3-MoE MTP draft (built in the engine environment) loads every one of its weights from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent_rl.config import TrainerConfig
from agent_rl.config.trainer import MtpConfig
from agent_rl.kernel.errors import ConfigError
from tests._engine_scripts import EngineScripts
from tests.trainer._batches import rl_batch
from trainer import hf_convert
from trainer.arch import ModelArch, Parallel, check_parallel
from trainer.learner import learner

pytestmark = pytest.mark.slow


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _mtp(cfg: TrainerConfig, **update: object) -> TrainerConfig:
    """`cfg` with its `trainer.mtp` settings `update`d (unvalidated, as a config file could
    not give them: the learner's own checks are the subject)."""
    return cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update=update)})


def _run(model: Path, steps: int, lr_warmup_steps: int = 0,
         **mtp: object) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`steps` RL steps on one batch with the `trainer.mtp` settings `mtp`."""
    batch = rl_batch(ModelArch.from_hf_dir(model).vocab_size, size=4)
    cfg = TrainerConfig(optim={"lr": 1e-3, "lr_warmup_steps": lr_warmup_steps},
                        micro_batch_size=2, mtp=mtp)
    with learner(model, cfg) as e:
        before = _params(e.module)
        metrics = [e.rl_step(batch) for _ in range(steps)]
        after = _params(e.module)
    return {"before": before, "after": after}, metrics  # type: ignore[return-value]


def test_a_detached_draft_learns_and_leaves_the_policy_bit_exact(tiny_moe_model: Path) -> None:
    plain, plain_metrics = _run(tiny_moe_model, 3)
    drafted, metrics = _run(tiny_moe_model, 3, layers=2, loss_coef=0.5)
    # Gradient clipping is active, so the drafts' grads would change the policy's step if the
    # global norm counted them.
    assert all(m["grad_norm"] > 1.0 for m in plain_metrics)
    trunk = {n: p for n, p in drafted["after"].items() if not n.startswith("mtp.")}
    assert trunk.keys() == plain["after"].keys()
    for name, value in trunk.items():
        assert torch.equal(value, plain["after"][name]), name
    assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in plain_metrics]
    draft = [n for n in drafted["after"] if n.startswith("mtp.layers.1.")]
    assert draft and all(not torch.equal(drafted["after"][n], drafted["before"][n]) for n in draft)
    for depth in (1, 2):
        nll = [m[f"mtp_nll_{depth}"] for m in metrics]
        assert nll[-1] < nll[0], (depth, nll)
    assert metrics[0]["mtp_loss"] == pytest.approx(
        (metrics[0]["mtp_nll_1"] + metrics[0]["mtp_nll_2"]) / 2
    )
    # The step's loss is the policy's plus the weighted MTP loss.
    assert metrics[0]["loss"] == pytest.approx(
        plain_metrics[0]["loss"] + 0.5 * metrics[0]["mtp_loss"], rel=1e-6
    )


def test_joint_training_lets_the_mtp_loss_move_the_policy(tiny_moe_model: Path) -> None:
    plain, _ = _run(tiny_moe_model, 1)
    joint, _ = _run(tiny_moe_model, 1, layers=1, detach=False)
    changed = [n for n, p in plain["after"].items() if not torch.equal(p, joint["after"][n])]
    assert "embedding.word_embeddings.weight" in changed
    assert any(n.startswith("decoder.layers.") for n in changed)


def test_the_draft_learns_at_its_own_rate_and_the_policy_at_its_own(tiny_moe_model: Path) -> None:
    """`mtp_lr`: the draft's Adam steps are its learning rate's, the policy's are bit-exact
    those of a run whose draft learns at the policy's rate; with a warm-up both ramp."""
    same, _ = _run(tiny_moe_model, 1, layers=1)
    fast, _ = _run(tiny_moe_model, 1, layers=1, lr=1e-2)
    warm, _ = _run(tiny_moe_model, 1, layers=1, lr=1e-2, lr_warmup_steps=4)
    draft = [n for n in same["after"] if n.startswith("mtp.")]
    assert draft
    for name, value in same["after"].items():
        if name not in draft:
            assert torch.equal(fast["after"][name], value), name

    def moved(run: dict[str, torch.Tensor], name: str) -> float:
        return (run["after"][name] - run["before"][name]).abs().max().item()

    # Adam's first step moves each weight by its learning rate (times ramp) wherever it has a
    # gradient: 1e-3 (the policy's `lr`), 1e-2, 1e-2 / 4.
    name = "mtp.layers.0.eh_proj.weight"
    assert moved(same, name) == pytest.approx(1e-3, rel=1e-3)
    assert moved(fast, name) == pytest.approx(1e-2, rel=1e-3)
    assert moved(warm, name) == pytest.approx(2.5e-3, rel=1e-3)
    trunk = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert moved(fast, trunk) == pytest.approx(1e-3, rel=1e-3)
    assert moved(warm, trunk) == pytest.approx(2.5e-4, rel=1e-3)
    expert = next(n for n in draft if ".experts." in n)  # named per megatron release
    assert moved(fast, expert) == pytest.approx(1e-2, rel=1e-3)  # the experts' own group


@pytest.mark.parametrize("detach", [True, False])
def test_a_frozen_draft_stays_bit_exact_and_is_still_measured(
    tiny_moe_model: Path, detach: bool
) -> None:
    """`mtp_train = false` (bench/mtp.py's frozen control): the draft's weights after steps
    are those it started with, its loss and acceptance are reported, and the policy trains as
    without MTP, joint training or not (a frozen draft's loss is not added)."""
    plain, plain_metrics = _run(tiny_moe_model, 2)
    frozen, metrics = _run(tiny_moe_model, 2, layers=1, train=False, detach=detach)
    draft = [n for n in frozen["after"] if n.startswith("mtp.")]
    assert draft
    for name in draft:
        assert torch.equal(frozen["after"][name], frozen["before"][name]), name
    for name, value in plain["after"].items():
        assert torch.equal(frozen["after"][name], value), name
    for m, p in zip(metrics, plain_metrics):
        assert 0.0 < m["mtp_acceptance_1"] < 1.0 and m["mtp_nll_1"] > 0.0
        assert m["mtp_accept_length"] == pytest.approx(m["mtp_acceptance_1"])
        assert m["loss"] == p["loss"]
    # The policy moved, so the frozen draft's acceptance is measured against a new policy.
    assert metrics[1]["mtp_acceptance_1"] != metrics[0]["mtp_acceptance_1"]


def test_logprob_forwards_skip_the_drafts(tiny_moe_model: Path) -> None:
    """`logprobs()` and the KL reference forward do not run the MTP modules (their drafts go
    unused), and give the logprobs of a learner without MTP."""
    batch = rl_batch(ModelArch.from_hf_dir(tiny_moe_model).vocab_size, size=4)
    cfg = TrainerConfig(micro_batch_size=2, loss={"kl_coef": 0.1})
    with learner(tiny_moe_model, cfg.model_copy(update={"mtp": MtpConfig(layers=1)})) as e:
        calls: list[int] = []
        e.module.mtp.register_forward_hook(lambda *args: calls.append(1))
        drafted = e.logprobs(batch)["logprobs"]
        assert calls == []
        e.rl_step(batch)
        assert calls == [1, 1]  # the step's two micro-batches, not the reference forward
    with learner(tiny_moe_model, cfg) as e:
        assert torch.equal(e.logprobs(batch)["logprobs"], drafted)


@pytest.mark.parametrize("model", ["tiny_moe_model", "tiny_dense_model"])
def test_packed_micro_batches_give_the_padded_mtp_loss(
    model: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(model)
    batch = rl_batch(ModelArch.from_hf_dir(path).vocab_size, size=6)
    out = []
    for packing in (None, 64):
        cfg = TrainerConfig(mtp={"layers": 2}, micro_batch_size=2, max_tokens_per_micro_batch=packing)
        with learner(path, cfg) as e:
            out.append(e.rl_step(batch))
    keys = ("mtp_nll_1", "mtp_nll_2", "mtp_loss", "loss", "mtp_acceptance_1",
            "mtp_acceptance_2", "mtp_accept_length")  # fmt: skip
    for key in keys:
        assert out[1][key] == pytest.approx(out[0][key], rel=1e-5, abs=1e-6), key


def test_checkpoint_resume_and_export_carry_the_draft(tiny_moe_model: Path, tmp_path: Path) -> None:
    arch = ModelArch.from_hf_dir(tiny_moe_model)
    batch = rl_batch(arch.vocab_size, size=4)
    # The draft at its own learning rate: the optimizer's two parameter groups resume too.
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 2, "lr": 3e-3})
    with learner(tiny_moe_model, cfg) as e:
        initial = _params(e.module)
        e.rl_step(batch)
        saved = e.save_checkpoint(tmp_path / "ckpt")
        expected = e.rl_step(batch)
        weights = _params(e.module)
        export = e.export_hf(tmp_path / "export")
    with learner(tiny_moe_model, cfg) as e:
        # A start without `mtp.*` weights initialises the draft, the same way each time.
        for name, value in _params(e.module).items():
            assert torch.equal(value, initial[name]), name
        assert e.load_checkpoint(saved) == 1
        resumed = e.rl_step(batch)
        for name, value in _params(e.module).items():
            assert torch.equal(value, weights[name]), name
    assert resumed["mtp_loss"] == expected["mtp_loss"] and resumed["loss"] == expected["loss"]

    names = set(hf_convert.read_safetensors(export))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.mlp.gate.weight", "mtp.1.fc.weight"} <= names
    _assert_loads_back(export, cfg, weights)


def _assert_loads_back(export: Path, cfg: TrainerConfig, weights: dict[str, torch.Tensor]) -> None:
    """`export` loads back into a learner with `cfg` bit-exact to `weights`, and without MTP
    as the policy alone (as SGLang's target does)."""
    for config in (cfg, TrainerConfig()):
        with learner(export, config) as e:
            for name, value in _params(e.module).items():
                assert torch.equal(value, weights[name]), name


def _qwen3_dense(tiny_dense_model: Path, out: Path) -> Path:
    """A dense Qwen3 (q/k norms, no q/k/v biases) of tiny-dense's sizes and tokenizer."""
    import json
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = json.loads((tiny_dense_model / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "tie_word_embeddings")  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**{k: hf[k] for k in keys if k in hf})).save_pretrained(out)
    for f in tiny_dense_model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = hf["rope_theta"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_a_dense_models_draft_is_an_eagle_module_exported_beside_and_as_its_own_dir(
    kind: str, tiny_dense_model: Path, tmp_path: Path
) -> None:
    """Dense Qwen2/Qwen3: the MTP modules take the EAGLE layout (no norms but the layer's
    post-attention one), export as `fc.*` and `layers.0.*` (zero `fc` bias; zero q/k/v biases
    where Qwen3 has none) in `draft/` with the config of SGLang's `Qwen2ForCausalLMEagle`, and
    for Qwen2 beside the target's weights too, in a file of their own (SGLang's Qwen3 target
    cannot skip them; transformers would load `layers.0.*` from `model.safetensors` into the
    target), and load back bit-exact, with or without MTP."""
    import json

    from safetensors import safe_open

    model = tiny_dense_model if kind == "qwen2" else _qwen3_dense(tiny_dense_model, tmp_path / "m")
    arch = ModelArch.from_hf_dir(model)
    assert arch.eagle_draft and arch.qk_norm == (kind == "qwen3")
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 2})
    with learner(model, cfg) as e:
        e.rl_step(rl_batch(arch.vocab_size, size=4))
        weights = _params(e.module)
        export = e.export_hf(tmp_path / "export")
    draft = [n.split(".", 3)[3] for n in weights if n.startswith("mtp.layers.0.")]
    assert not [n for n in draft if "norm" in n and "pre_mlp_layernorm" not in n], draft
    ours = hf_convert.read_safetensors(export)
    assert not ours["fc.bias"].any() and not ours["mtp.1.fc.bias"].any()
    biases = [ours[f"layers.0.self_attn.{x}_proj.bias"] for x in "qkv"]
    assert all(b.any() for b in biases) if kind == "qwen2" else not any(b.any() for b in biases)
    assert not any("norm" in n and "post_attention" not in n
                   for n in ours if n.startswith("layers."))  # fmt: skip
    on_its_own = hf_convert.read_safetensors(export / "draft")
    assert sorted(on_its_own) == sorted(n for n in ours if hf_convert.is_draft(n))
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if hf_convert.is_draft(n)]  # noqa: SIM118
    beside = export / hf_convert.EAGLE_BESIDE_FILE
    if kind == "qwen2":
        assert sorted(hf_convert.read_safetensors(export).keys()) == sorted(ours)
        with safe_open(str(beside), "pt") as f:
            assert sorted(f.keys()) == sorted(on_its_own)  # noqa: SIM118
    else:
        assert not beside.exists()
    config = json.loads((export / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLMEagle"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (1, arch.hidden_size)
    _assert_loads_back(export, cfg, weights)
    # A dense draft in the MoE's MTP layout (as exports before the EAGLE one had it): refused.
    mtp_named = {("mtp." + k if hf_convert.is_draft(k) and not k.startswith("mtp.") else k): v
                 for k, v in ours.items()}  # fmt: skip
    with pytest.raises(ConfigError, match="MTP-layout draft"):
        hf_convert.hf_to_mcore(mtp_named, arch, mtp_layers=2)


def test_a_dense_models_draft_may_be_narrower_than_the_model(
    tiny_dense_model: Path, tiny_moe_model: Path, tmp_path: Path
) -> None:
    """`trainer.mtp.ffn_hidden_size` and `trainer.mtp.num_attention_heads`: the EAGLE draft's
    MLP that wide and its attention with that many heads, each the model's head_dim wide (the
    trunk's stay the model's), trained, resumed from a checkpoint and exported with
    `draft/config.json` saying so (`intermediate_size`, `num_attention_heads`,
    `num_key_value_heads`, `head_dim`), each bit-exact; weights of another shape are refused
    naming the setting, and so are the settings for a Qwen3-MoE (SGLang builds its MTP draft
    from the model's own config) and heads the parallel split or the model's key/value heads
    do not divide."""
    import json

    arch = ModelArch.from_hf_dir(tiny_dense_model)
    width, d = arch.ffn_hidden_size // 4, arch.head_dim
    assert arch.num_heads > 2 and arch.num_kv_heads == 2
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2,
                        mtp={"layers": 1, "ffn_hidden_size": width, "num_attention_heads": 1})
    batch = rl_batch(arch.vocab_size, size=4)
    with learner(tiny_dense_model, cfg) as e:
        before = _params(e.module)
        e.rl_step(batch)
        saved = e.save_checkpoint(tmp_path / "ckpt")
        e.rl_step(batch)
        weights = _params(e.module)
        export = e.export_hf(tmp_path / "export")
    with learner(tiny_dense_model, cfg) as e:
        assert e.load_checkpoint(saved) == 1
        e.rl_step(batch)
        for name, value in _params(e.module).items():
            assert torch.equal(value, weights[name]), name

    def shapes(suffix: str) -> dict[bool, set[tuple[int, ...]]]:
        """The shapes of the parameters named `*suffix`, of the draft (True) and the trunk."""
        found: dict[bool, set[tuple[int, ...]]] = {True: set(), False: set()}
        for n, w in weights.items():
            if n.endswith(suffix):
                found[n.startswith("mtp.")].add(tuple(w.shape))
        return found

    assert shapes("mlp.linear_fc2.weight") == {
        True: {(arch.hidden_size, width)}, False: {(arch.hidden_size, arch.ffn_hidden_size)}}
    # One query head and one key/value head (fewer than the model's two), each d wide.
    assert shapes("self_attention.linear_qkv.weight") == {
        True: {(3 * d, arch.hidden_size)},
        False: {((arch.num_heads + 2 * arch.num_kv_heads) * d, arch.hidden_size)}}
    assert shapes("self_attention.linear_proj.weight") == {
        True: {(arch.hidden_size, d)}, False: {(arch.hidden_size, arch.num_heads * d)}}
    for draft_weight in ("mlp.linear_fc2.weight", "self_attention.linear_qkv.weight"):
        name = next(n for n in weights if n.startswith("mtp.") and n.endswith(draft_weight))
        assert not torch.equal(before[name], weights[name]), name
    ours = hf_convert.read_safetensors(export)
    assert ours["layers.0.mlp.down_proj.weight"].shape == (arch.hidden_size, width)
    assert ours["layers.0.self_attn.q_proj.weight"].shape == (d, arch.hidden_size)
    assert ours["layers.0.self_attn.o_proj.weight"].shape == (arch.hidden_size, d)
    draft_config = json.loads((export / "draft" / "config.json").read_text())
    assert {k: draft_config[k] for k in ("intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim")} == {
        "intermediate_size": width, "num_attention_heads": 1, "num_key_value_heads": 1,
        "head_dim": d}  # fmt: skip
    target = json.loads((export / "config.json").read_text())
    assert target["intermediate_size"] == arch.ffn_hidden_size
    assert target["num_attention_heads"] == arch.num_heads
    _assert_loads_back(export, cfg, weights)
    with pytest.raises(ConfigError, match="draft's MLP width is trainer.mtp.ffn_hidden_size"):
        with learner(export, _mtp(cfg, ffn_hidden_size=None)):
            pass
    with pytest.raises(ConfigError, match="attention heads are trainer.mtp.num_attention_heads"):
        with learner(export, _mtp(cfg, num_attention_heads=None)):
            pass
    with pytest.raises(ConfigError, match=r"tp=2 does not divide the model's draft ffn size"):
        check_parallel(arch, Parallel(tp=2), mtp_layers=1, mtp_ffn_hidden_size=width + 1)
    with pytest.raises(ConfigError, match=r"tp=2 does not divide the model's draft attention"):
        check_parallel(arch, Parallel(tp=2), mtp_layers=1, mtp_num_attention_heads=1)
    with pytest.raises(ConfigError, match="2 key/value heads .* must divide its query heads"):
        check_parallel(arch, Parallel(), mtp_layers=1, mtp_num_attention_heads=3)
    check_parallel(arch, Parallel(tp=2), mtp_layers=1, mtp_num_attention_heads=2)
    for setting in ("ffn_hidden_size", "num_attention_heads"):
        moe = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 1, setting: 1})
        with pytest.raises(ConfigError, match=f"trainer.mtp.{setting} needs a dense model"):
            with learner(tiny_moe_model, moe):
                pass


@pytest.mark.parametrize("shape", ["model", "narrow"])
def test_the_trained_eagle_draft_computes_what_its_export_does_in_the_eagle_layout(
    shape: str, tiny_dense_model: Path, tmp_path: Path
) -> None:
    """The draft the learner trains is the function its export describes: rebuilt from the
    export alone with transformers' Qwen2 layers in the layout SGLang's `Qwen2ForCausalLMEagle`
    serves (`fc(cat(embedding of the next token, the target's last hidden state))`, the
    decoder layer of `draft/config.json` without its input norm, no final norm, the target's
    head), it gives the learner's draft logits. `narrow`: the draft's own MLP width and
    attention heads (2 query and 2 key/value heads against the model's 4 and 2: a grouping the
    export has to regroup), so the conversion of a draft's own heads is checked by value, not
    only by shape."""
    import json

    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2

    arch = ModelArch.from_hf_dir(tiny_dense_model)
    own = ({"ffn_hidden_size": arch.ffn_hidden_size // 4, "num_attention_heads": 2}
           if shape == "narrow" else {})  # fmt: skip
    cfg = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 1, **own})
    batch = rl_batch(arch.vocab_size, size=4)
    with learner(tiny_dense_model, cfg) as e:
        e.rl_step(batch)  # a trained draft, not its initialisation
        export = e.export_hf(tmp_path / "export")
        model = e.module
        with torch.no_grad():
            positions = torch.arange(batch.length).unsqueeze(0).expand(batch.size, -1)
            policy, (hidden,) = model(batch.tokens, positions, None)
            rows, cols = torch.meshgrid(torch.arange(batch.size),
                                        torch.arange(batch.length - 1), indexing="ij")
            ours = model.draft_logits(hidden, rows.flatten(), cols.flatten())
    ours = ours.reshape(batch.size, batch.length - 1, -1)

    draft_dir = export / "draft"
    config = Qwen2Config(**json.loads((draft_dir / "config.json").read_text()))
    config._attn_implementation = "eager"
    weights = hf_convert.read_safetensors(draft_dir)
    layer = modeling_qwen2.Qwen2DecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()  # SGLang's EAGLE layer 0 has none
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items()
                           if k.startswith("layers.0.")})  # fmt: skip
    # transformers loads the export as the target the learner trained: the draft's weights
    # beside it (`layers.0.*`, prefix-less) are not taken for the target's first layer.
    target = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(target(batch.tokens).logits, policy, atol=2e-4)
        trunk = target.model(batch.tokens).last_hidden_state[:, :-1]
        embedded = target.model.embed_tokens(batch.tokens[:, 1:])
        x = torch.nn.functional.linear(torch.cat([embedded, trunk], dim=-1),
                                       weights["fc.weight"], weights["fc.bias"])  # fmt: skip
        steps = torch.arange(batch.length - 1).unsqueeze(0)
        rotary = modeling_qwen2.Qwen2RotaryEmbedding(config)(x, steps)
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=causal, position_ids=steps, position_embeddings=rotary)
        theirs = target.lm_head(out)
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        (2, 2) if shape == "narrow" else (arch.num_heads, arch.num_kv_heads))
    assert torch.allclose(ours, theirs, atol=2e-4), (ours - theirs).abs().max()


def _sglang_draft_loads(
    model: Path, engine_scripts: EngineScripts, tmp_path: Path, **cfg: object
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A learner with two MTP modules after one step: its export, and SGLang's own draft for
    the model (tests/trainer/_sglang_mtp_draft.py, in the engine environment) after loading
    each source of weights: `disk` (the export: what a disk sync loads into target and draft),
    for an EAGLE draft `launch` (its `draft/` directory) and `target` (SGLang's target model on
    the export), and the buckets an in-memory sync sends with `selector: "draft"`
    (trainer.weight_sync.memory.parts), received and reconstructed by SGLang's own flattened
    bucket as a `distributed` and a `tensor` update hand them to the draft."""
    from tests.trainer._syncs import save_draft_buckets, sglang_draft_loads

    batch = rl_batch(ModelArch.from_hf_dir(model).vocab_size, size=4)
    config = TrainerConfig(optim={"lr": 1e-3}, micro_batch_size=2, mtp={"layers": 2, **cfg})
    with learner(model, config) as e:
        e.rl_step(batch)
        export = e.export_hf(tmp_path / "export")
        drafts = save_draft_buckets(e.hf_state_dict(), tmp_path / "buckets.pt")
    assert len(drafts) > 1 and all(hf_convert.is_draft(n) for b in drafts for n in b)
    return hf_convert.read_safetensors(export), sglang_draft_loads(export, engine_scripts, tmp_path)


def test_sglang_s_own_mtp_draft_loads_every_weight_of_the_export_and_of_a_sync(
    tiny_moe_model: Path, engine_scripts: EngineScripts, tmp_path: Path
) -> None:
    """SGLang's `Qwen3MoeForCausalLMMTP` gets every parameter from the export's module 0 (the
    embedding and head are the target's, shared at serve time), and so from the buckets of
    both in-memory syncs: every weight sync updates the served draft. The later module's
    `mtp.1.*` weights are skipped, not loaded over module 0."""
    ours, loaded = _sglang_draft_loads(tiny_moe_model, engine_scripts, tmp_path)
    assert sorted(loaded) == ["disk", "distributed", "tensor"]
    for source, draft in loaded.items():
        _assert_module_0(draft, ours, source)
    assert not torch.equal(ours["mtp.fc.weight"], ours["mtp.1.fc.weight"])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen2-narrow"])
def test_sglang_s_own_eagle_draft_loads_a_dense_models_draft_from_every_source(
    kind: str, tiny_dense_model: Path, engine_scripts: EngineScripts, tmp_path: Path
) -> None:
    """A dense model's MTP module is in the EAGLE layout: SGLang's `Qwen2ForCausalLMEagle`,
    built from the export's `draft/` config, gets every parameter but the shared embedding and
    head from module 0, whether loaded from `draft/` (a launch) or from either in-memory sync's
    draft buckets, and for Qwen2 from the export itself (a disk sync loads target and draft
    from it); a Qwen3 export does not carry the draft, so a disk sync leaves it as it was. Its
    `fc` bias is zero (the learner's projection has none). SGLang's target (Qwen2, Qwen3) fills
    every one of its parameters from the same export, skipping the draft's. `qwen2-narrow`: a
    draft whose MLP is narrower than the model's (`trainer.mtp.ffn_hidden_size`) and whose
    attention has fewer heads (`trainer.mtp.num_attention_heads`), built by SGLang at the shape
    its `draft/` config gives."""
    qwen3 = kind == "qwen3"
    model = _qwen3_dense(tiny_dense_model, tmp_path / "m") if qwen3 else tiny_dense_model
    arch = ModelArch.from_hf_dir(model)
    narrow = arch.ffn_hidden_size // 4 if kind.endswith("narrow") else None
    heads = 2 if narrow else None  # the model's 4 query heads, 2 key/value heads
    ours, loaded = _sglang_draft_loads(model, engine_scripts, tmp_path, ffn_hidden_size=narrow,
                                       num_attention_heads=heads)  # fmt: skip
    if narrow:
        launch = loaded["launch"]
        assert launch["model.layers.0.mlp.down_proj.weight"].shape[1] == narrow
        assert launch["model.layers.0.self_attn.o_proj.weight"].shape[1] == 2 * arch.head_dim
        assert launch["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == 6 * arch.head_dim
    assert sorted(loaded) == ["disk", "distributed", "launch", "target", "tensor"]
    target = loaded.pop("target")
    assert not [n for n, t in target.items() if torch.isnan(t).any()]
    for name in ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):  # not the draft's layers.0.*
        assert torch.equal(target[name], ours[name]), name
    if qwen3:
        assert torch.isnan(loaded.pop("disk")["model.fc.weight"]).all()
    for source, draft in loaded.items():
        shared = {"model.embed_tokens.weight", "lm_head.weight"}
        unfilled = [n for n, t in draft.items() if n not in shared and torch.isnan(t).any()]
        assert not unfilled and len(draft) > len(shared) + 4, (source, unfilled)
        fused = {n for n in draft if "qkv_proj" in n or "gate_up_proj" in n}
        for name in draft.keys() - shared - fused:
            assert torch.equal(draft[name], ours[name.removeprefix("model.")]), (source, name)
        assert not draft["model.fc.bias"].any()
    assert not torch.equal(ours["fc.weight"], ours["mtp.1.fc.weight"])


def _assert_module_0(draft: dict[str, torch.Tensor], ours: dict[str, torch.Tensor],
                     source: str) -> None:  # fmt: skip
    """Every parameter of SGLang's draft but the shared embedding and head was filled, and
    where SGLang keeps a weight as one tensor (not fused: qkv_proj, experts.w13/w2) it is the
    export's module-0 tensor."""
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    assert shared <= draft.keys()
    unfilled = [n for n, t in draft.items() if n not in shared and torch.isnan(t).any()]
    assert not unfilled and len(draft) > len(shared) + 5, (source, unfilled)
    direct = {"fc.weight": "mtp.fc.weight", "model.norm.weight": "mtp.norm.weight",
              "pre_fc_norm_embedding.weight": "mtp.pre_fc_norm_embedding.weight",
              "pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight"}  # fmt: skip
    compared = []
    for name, tensor in draft.items():
        origin = direct.get(name, "mtp." + name.removeprefix("model."))
        if name not in shared and origin in ours:
            assert torch.equal(tensor, ours[origin]), (source, name)
            compared.append(name)
    fused = [n for n in draft if "qkv_proj" in n or ".experts.w" in n]
    assert sorted(compared + fused) == sorted(draft.keys() - shared), source


def test_acceptance_is_the_overlap_of_policy_and_draft_and_chains_into_a_length(solo: None) -> None:
    """Against a direct per-position computation: anchor t, depth j compares the draft's
    distribution at t with the policy's at t+j (both predict token t+1+j)."""
    from trainer import mtp

    g = torch.Generator().manual_seed(0)
    policy, drafts = torch.randn(2, 7, 11, generator=g), [torch.randn(2, 7, 11, generator=g)
                                                          for _ in range(2)]  # fmt: skip
    alphas = [mtp.acceptance(policy, d, j) for j, d in enumerate(drafts, start=1)]
    for j, (alpha, draft) in enumerate(zip(alphas, drafts), start=1):
        assert alpha.shape == (2, 6)
        for b in range(2):
            for t in range(6):
                expected = 0.0
                if t + 1 + j <= 6:
                    p, q = policy[b, t + j].softmax(-1), draft[b, t].softmax(-1)
                    expected = float(torch.minimum(p, q).sum())
                assert float(alpha[b, t]) == pytest.approx(expected, abs=1e-6), (j, b, t)
        rows, anchors = torch.tensor([0, 1, 1]), torch.tensor([0, 2, 5 - j])
        assert torch.allclose(mtp.overlap(policy[rows, anchors + j], draft[rows, anchors]),
                              alpha[rows, anchors], atol=1e-7)
    same = mtp.acceptance(policy, policy[:, 1:], 1)  # the draft at t is the policy at t+1
    assert same[:, :5].sub(1).abs().max() < 1e-6 and not same[:, 5].any()
    masks = [torch.ones(2, 6), torch.ones(2, 6)]
    masks[1][:, 3] = 0  # the second draft's target at anchor 3 is not a policy token
    length = mtp.accepted_length(alphas, masks)
    expected = alphas[0] * masks[0] * (1 + alphas[1] * masks[1])
    assert torch.allclose(length, expected)
    assert torch.equal(mtp.accepted_length([torch.ones(1, 3)] * 3, [torch.ones(1, 3)] * 3),
                       torch.full((1, 3), 3.0))  # fmt: skip


def test_the_draft_objectives_are_the_samples_nll_the_kl_and_one_minus_the_acceptance(
    solo: None,
) -> None:
    """`trainer.mtp.objective` per anchor, against direct computations: nll of the sampled
    token, forward KL from the policy's distribution, and total variation, which is one minus
    the acceptance the step reports; only the draft gets a gradient."""
    from trainer import mtp

    g = torch.Generator().manual_seed(0)
    policy = torch.randn(5, 11, generator=g, requires_grad=True)
    draft = torch.randn(5, 11, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 4, 4])
    p, log_q = policy.detach().softmax(-1), draft.detach().log_softmax(-1)
    expected = {
        "nll": -log_q.gather(1, targets[:, None])[:, 0],
        "kl": (p * (p.log() - log_q)).sum(-1),
        "tv": 0.5 * (p - log_q.exp()).abs().sum(-1),
    }
    accepted = mtp.overlap(policy.detach(), draft.detach())
    assert torch.allclose(expected["tv"], 1 - accepted, atol=1e-6)
    for objective, value in expected.items():
        loss, nll, alpha = mtp.draft_terms(draft, policy, targets, objective)
        assert torch.allclose(loss, value, atol=1e-6), objective
        # Every objective also gives the nll and the acceptance, detached.
        assert torch.allclose(nll, expected["nll"], atol=1e-6), objective
        assert torch.allclose(alpha, accepted, atol=1e-6), objective
        assert not nll.requires_grad and not alpha.requires_grad
        loss.sum().backward()
        assert policy.grad is None and draft.grad is not None and draft.grad.abs().sum() > 0
        draft.grad = None
    for objective in ("kl", "tv"):  # a draft equal to the policy is at the minimum, 0
        same, _, alpha = mtp.draft_terms(policy.detach(), policy, targets, objective)
        assert same.abs().max() < 1e-6 and (alpha - 1).abs().max() < 1e-6, objective
    with pytest.raises(ValueError, match="unknown MTP objective"):
        mtp.draft_terms(draft, policy, targets, "l2")


@pytest.mark.parametrize("objective", ["kl", "tv"])
def test_a_draft_distilled_from_the_policy_learns_and_leaves_the_policy_bit_exact(
    tiny_moe_model: Path, objective: str
) -> None:
    plain, _ = _run(tiny_moe_model, 3)
    drafted, metrics = _run(tiny_moe_model, 3, layers=1, objective=objective)
    for name, value in plain["after"].items():
        assert torch.equal(value, drafted["after"][name]), name
    losses = [m["mtp_loss"] for m in metrics]
    assert losses[-1] < losses[0], losses
    if objective == "tv":  # the loss is one minus the acceptance, at the step's start
        assert all(m["mtp_loss"] == pytest.approx(1 - m["mtp_acceptance_1"], abs=1e-5)
                   for m in metrics)  # fmt: skip
    # SFT steps train the draft on the demonstrations' tokens, whatever the RL objective.
    batch = rl_batch(ModelArch.from_hf_dir(tiny_moe_model).vocab_size, size=4)
    cfg = TrainerConfig(micro_batch_size=2, mtp={"layers": 1, "objective": objective})
    with learner(tiny_moe_model, cfg) as e:
        sft = e.sft_step(batch)
    assert sft["mtp_loss"] == pytest.approx(sft["mtp_nll_1"], rel=1e-6)


def test_the_drafts_head_at_the_anchors_is_the_output_layer_there(tiny_moe_model: Path) -> None:
    """The step runs a draft's head only where its target is a policy token: those logits are
    the output layer's over the whole sequence, picked at the anchors, and the loss there is
    the full sequence's loss under the shifted mask."""
    from trainer import mtp

    batch = rl_batch(ModelArch.from_hf_dir(tiny_moe_model).vocab_size, size=4)
    with learner(tiny_moe_model, TrainerConfig(mtp={"layers": 2})) as e, torch.no_grad():
        model = e.module
        positions = torch.arange(batch.length).unsqueeze(0).expand(batch.size, -1)
        _, drafts = model(batch.tokens, positions, None)
        mask = batch.loss_mask[:, 1:]
        for depth, hidden in enumerate(drafts, start=1):
            full = model.output_layer(hidden, weight=model.shared_embedding_or_output_weight()
                                      if model.share_embeddings_and_output_weights else None)[0]
            full = full.transpose(0, 1)  # [b, s, V]
            rows, cols = mtp.shifted_mask(mask, depth).nonzero(as_tuple=True)
            assert 0 < len(rows) < mask.numel()
            at = model.draft_logits(hidden, rows, cols)
            assert torch.allclose(at, full[rows, cols], atol=1e-5)
            targets = batch.tokens[rows, cols + 1 + depth]
            expected = full[rows, cols].float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
            assert torch.allclose(mtp.draft_scores(at, targets), expected, atol=1e-5)


def test_a_step_reports_the_drafts_acceptance(tiny_moe_model: Path) -> None:
    _, one = _run(tiny_moe_model, 1, layers=1)
    # With one draft, the expected accepted length is its acceptance.
    assert one[0]["mtp_accept_length"] == pytest.approx(one[0]["mtp_acceptance_1"], rel=1e-6)
    _, two = _run(tiny_moe_model, 1, layers=2)
    a1, a2 = two[0]["mtp_acceptance_1"], two[0]["mtp_acceptance_2"]
    assert 0 < a2 and 0 < a1 < 1 and a1 < two[0]["mtp_accept_length"] < a1 + a2


def test_tp2_and_ep2_train_the_draft_as_one_process_does(
    tiny_moe_model: Path, tmp_path: Path
) -> None:
    """torchrun, two gloo CPU ranks: the draft loads its `mtp.*` shards, and the vocab-parallel
    MTP loss and acceptance, the sharded `eh_proj` and the draft's experts train and export as
    in one process, with the draft's loss its sampled tokens' nll or (tp2+mtp1tv) its total
    variation from the policy, computed on the gathered vocabulary. (They start from an export
    with a draft: megatron initialises expert and TP-split weights differently per layout.)"""
    from tests.trainer._parallel_worker import train
    from tests.trainer.test_parallel import _compare, _launch, _metrics
    from trainer import dist_env

    with learner(tiny_moe_model, TrainerConfig(mtp={"layers": 1})) as e:
        start = e.export_hf(tmp_path / "start")
    try:
        train(start, tmp_path / "one", mtp_layers=1)
        train(start, tmp_path / "one_tv", mtp_layers=1, mtp_objective="tv")
    finally:
        dist_env.teardown()
    _launch(start, tmp_path, "ep2+mtp1", "tp2+mtp1", "tp2+mtp1tv")
    for run, one in (("ep2+mtp1", "one"), ("tp2+mtp1", "one"), ("tp2+mtp1tv", "one_tv")):
        other = _metrics(tmp_path / run)
        base = _metrics(tmp_path / one)
        # tv's gradient is that of min(p, q), whose branch flips where p and q agree to the
        # rounding the sharded sums change; Adam moves such a weight by up to lr (1e-3) a step.
        _compare(base, other, tmp_path / one, tmp_path / run, 1e-3 if "tv" in run else 1e-4)
        for a, b in zip(base, other):
            for key in ("mtp_loss", "mtp_acceptance_1", "mtp_accept_length"):
                assert abs(a[key] - b[key]) < 1e-4, (run, key, a[key], b[key])
    # The objective reached the ranks: tv's loss is one minus the acceptance, nll's is not.
    for step in _metrics(tmp_path / "tp2+mtp1tv")[:2]:
        assert step["mtp_loss"] == pytest.approx(1 - step["mtp_acceptance_1"], abs=1e-5)
    assert _metrics(tmp_path / "tp2+mtp1")[0]["mtp_loss"] > 1.5


def test_bf16_packed_rl_and_sft_steps_train_the_draft(tiny_moe_model: Path, tmp_path: Path) -> None:
    batch = rl_batch(ModelArch.from_hf_dir(tiny_moe_model).vocab_size, size=4)
    cfg = TrainerConfig(optim={"lr": 1e-3}, mtp={"layers": 1}, dtype="bf16",
                        max_tokens_per_micro_batch=64)
    with learner(tiny_moe_model, cfg) as e:
        before = _params(e.module)
        rl = e.rl_step(batch)
        sft = e.sft_step(batch)
        weights = _params(e.module)
        export = e.export_hf(tmp_path / "export")
    for metrics in (rl, sft):
        assert metrics["update_ok"] == 1.0 and 0 < metrics["mtp_acceptance_1"] < 1
        assert 0 < metrics["mtp_nll_1"] < 10
    assert not torch.equal(weights["mtp.layers.0.eh_proj.weight"],
                           before["mtp.layers.0.eh_proj.weight"])  # fmt: skip
    with learner(export, cfg) as e:
        for name, value in _params(e.module).items():
            assert torch.equal(value, weights[name]), name
