"""What an HF model directory says about the network, and how it may be split.

`ModelArch.from_hf_dir` reads config.json (through transformers' AutoConfig, which resolves
aliases such as `rope_parameters.rope_theta` and `num_local_experts`) into the handful of numbers
the conversion and the Megatron build need, and refuses architectures whose weights we could not
map exactly. `Parallel` holds the model-parallel sizes and `check_parallel` says whether a model
can be split that way. Light to import: no torch, no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent_rl.kernel.errors import ConfigError

SUPPORTED = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelArch:
    """What the HF config says about the network, in the terms the converter needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def eagle_draft(self) -> bool:
        """Whether the MTP draft (`trainer.mtp.layers`) takes the EAGLE layout SGLang serves for
        a dense model (`Qwen2ForCausalLMEagle`: no norms around the draft's projection or after
        its layer, the layer without its input norm or a q/k norm) rather than the MTP one its
        `Qwen3MoeForCausalLMMTP` serves for Qwen3-MoE (trainer.mtp_model)."""
        return not self.is_moe

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelArch:
        """Read `path/config.json`; raise ConfigError naming the problem if we cannot map it."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is not a HuggingFace model directory (no config.json)")
        try:
            hf = AutoConfig.from_pretrained(path)
        except Exception as e:  # transformers raises many types for a bad config; all mean the same
            reason = " ".join(str(e).split())
            raise ConfigError(f"{path}/config.json is not a valid model config: {reason}") from e
        kind = hf.model_type
        if kind not in SUPPORTED:
            raise ConfigError(
                f"{path}: model_type {kind!r} is not supported; use one of {SUPPORTED}"
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
        if rope.get("rope_type", "default") != "default" or rope_theta is None:
            raise ConfigError(
                f"{path}: only default rotary embeddings with rope_theta are supported"
            )
        if getattr(hf, "use_sliding_window", False):
            raise ConfigError(f"{path}: sliding-window attention is not supported")
        if hf.hidden_act != "silu":
            raise ConfigError(f"{path}: hidden_act {hf.hidden_act!r} is not supported (silu only)")
        if kind != "qwen2" and getattr(hf, "attention_bias", False):
            raise ConfigError(f"{path}: attention_bias=true (bias on o_proj) is not supported")
        moe: dict[str, int | bool] = {}
        if kind == "qwen3_moe":
            if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
                raise ConfigError(f"{path}: mixed dense/MoE layers are not supported")
            moe = {
                "num_experts": hf.num_experts,
                "moe_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.moe_intermediate_size,
                "norm_topk_prob": bool(hf.norm_topk_prob),
            }
        return cls(
            model_type=kind,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            ffn_hidden_size=hf.intermediate_size,
            rope_theta=float(rope_theta),
            rms_eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            qkv_bias=kind == "qwen2",
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            tied_embeddings=bool(hf.tie_word_embeddings),
            **moe,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes; data parallelism is whatever the world size leaves."""

    tp: int = 1
    pp: int = 1
    ep: int = 1


def draft_heads(arch: ModelArch, heads: int | None) -> tuple[int, int] | None:
    """The query and key/value heads of a dense model's EAGLE draft layer with
    `trainer.mtp.num_attention_heads` = `heads` (None: the model's own, so None): as many
    key/value heads as the model has, or as the draft has query heads where those are fewer,
    each head the model's head_dim wide. Raise ConfigError when the key/value heads do not
    divide them."""
    if heads is None:
        return None
    groups = min(heads, arch.num_kv_heads)
    if heads % groups:
        raise ConfigError(
            f"trainer.mtp.num_attention_heads = {heads}: the draft's {groups} key/value heads "
            f"(the model's {arch.num_kv_heads}, or fewer) must divide its query heads"
        )
    return heads, groups


def check_parallel(
    arch: ModelArch,
    par: Parallel,
    mtp_layers: int = 0,
    mtp_ffn_hidden_size: int | None = None,
    mtp_num_attention_heads: int | None = None,
) -> None:
    """Raise ConfigError when the model cannot be split as asked (with `mtp_layers` MTP draft
    modules, their MLPs `mtp_ffn_hidden_size` wide and their attention
    `mtp_num_attention_heads` heads), or its draft cannot be built so."""
    own = {"mtp.ffn_hidden_size": mtp_ffn_hidden_size,
           "mtp.num_attention_heads": mtp_num_attention_heads}  # fmt: skip
    for name, value in own.items():
        if mtp_layers and value is not None and not arch.eagle_draft:
            raise ConfigError(
                f"trainer.{name} needs a dense model (an EAGLE draft, with a config of its "
                "own); SGLang builds a Qwen3-MoE's MTP draft from the model's config: unset it"
            )
    own_heads = draft_heads(arch, mtp_num_attention_heads) if mtp_layers else None
    heads, groups = own_heads or (None, None)
    if arch.num_layers % par.pp:
        raise ConfigError(
            f"pp={par.pp} does not divide the model's {arch.num_layers} layers"
        )
    if par.pp > 1 and mtp_layers:
        raise ConfigError(
            "mtp_layers > 0 with pp > 1 is not supported: the MTP drafts would run on the last "
            "pipeline stage with a copy of the embedding, which the trainer does not load, "
            "train or export; set trainer.parallel.pp = 1 or trainer.mtp.layers = 0"
        )
    for what, n in (
        ("attention heads", arch.num_heads),
        ("kv heads", arch.num_kv_heads),
        ("vocab size", arch.vocab_size),
        ("ffn size", arch.ffn_hidden_size),
        ("draft ffn size (trainer.mtp.ffn_hidden_size)",
         mtp_ffn_hidden_size if mtp_layers else None),
        ("draft attention heads (trainer.mtp.num_attention_heads)", heads),
        ("draft kv heads", groups),
    ):
        if n is None:
            continue
        if n % par.tp:
            raise ConfigError(f"tp={par.tp} does not divide the model's {what} ({n})")
    if par.ep > 1 and (not arch.is_moe or arch.num_experts % par.ep):
        raise ConfigError(f"ep={par.ep} needs a MoE model whose expert count it divides")
