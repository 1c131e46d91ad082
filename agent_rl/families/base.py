"""What a model family is: the contract each family module fills, and the network it describes.

A family (one module in this folder, found by HF `model_type` through registry.py) says
everything that is true of it and of nothing else:
- how its HF config reads into `ModelArch` (arch.py), the handful of numbers the conversion
  and the megatron build need, and what it refuses (`Family.read_config`);
- what megatron-core needs beyond the layer spec those numbers choose (`megatron_config`,
  `gpt_model_kwargs`: router settings, rope scaling);
- its weights' HF <-> megatron names and layouts per decoder layer (`layer_to_mcore`,
  `layer_to_hf`; the standard layout in `layout.py` unless a family overrides them);
- the class transformers and SGLang build it as, and how SGLang serves its MTP draft;
- its tiny presets for `agent-rl model init` (`presets`, `tiny_config`);
- what it cannot do: its module's docstring, and a ConfigError where a config asks for it.

Light to import: no torch, no transformers, no megatron at module level (the CLI's help and
SGLang's launcher read the registry); the methods that need them import them when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from agent_rl.families.arch import ModelArch
from agent_rl.kernel.errors import ConfigError

if TYPE_CHECKING:
    import torch

Weights = dict[str, "torch.Tensor"]

EAGLE_DRAFT_ARCHITECTURE = "Qwen2ForCausalLMEagle"
"""SGLang's EAGLE draft class, for every family whose draft is an EAGLE one (`Family.draft`):
a one-layer Qwen2 decoder whose embedding and head are the target's."""
EAGLE_DRAFT_MODEL_TYPE = "qwen2"
"""The `model_type` of that draft's config."""


class Family:
    """One HF model family. Subclasses set the class attributes and override the hooks where
    the family differs from the standard decoder (RMSNorm, SwiGLU, GQA, rotary embeddings)."""

    model_type: ClassVar[str]
    """HF `model_type`, the registry's key."""
    architecture: ClassVar[str]
    """The class transformers and SGLang build it as (config.json's `architectures[0]`)."""
    config_class: ClassVar[str]
    """transformers' config class, for the tiny presets."""
    qkv_bias: ClassVar[bool] = False
    """Bias on the q/k/v projections (none on the output projection)."""
    qk_norm: ClassVar[bool] = False
    """Per-head RMSNorm on queries and keys."""
    draft: ClassVar[Literal["eagle", "mtp"] | None] = "eagle"
    """How SGLang serves the MTP draft an export carries: an EAGLE draft in `draft/`
    (`Qwen2ForCausalLMEagle`), or the model's own `mtp.*` weights; None: no draft yet
    (`trainer.mtp.layers` is refused)."""
    mtp_draft_architecture: ClassVar[str | None] = None
    """For `draft = "mtp"`: the class SGLang serves the `mtp.*` draft as, from the target's own
    directory."""
    native_mtp: ClassVar[bool] = False
    """For `draft = "mtp"`: the draft's modules are the model's native NextN layers
    (`model.layers.{num_hidden_layers + j}.*`: `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`
    beside a decoder layer, as many as config.json's `num_nextn_predict_layers`; GLM-4.5's and
    DeepSeek-V3's layout), not Qwen3-MoE's `mtp.*` (trainer.hf_convert)."""
    sglang_fused: ClassVar[tuple[tuple[str, ...], ...]] = ()
    """Weights of one layer (HF name suffixes after the layer's prefix) that SGLang's model
    fuses into one parameter only when a single `load_weights` call holds them all: an
    in-memory sync sends each such group in one bucket (trainer.hf_convert.load_groups)."""
    eagle_beside_target: ClassVar[bool] = False
    """Whether the export also carries the EAGLE draft beside the target's weights
    (`draft.safetensors`), which only a target that skips unknown names (SGLang's Qwen2) allows;
    then a disk update reaches the draft too."""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    """Tiny presets for `agent-rl model init`: name -> `agent_rl.models.ModelPreset` fields."""
    preset_options: ClassVar[tuple[str, ...]] = ()
    """The settings of its own a preset may carry (`ModelPreset.options`), for `tiny_config`."""

    # --- HF config -> ModelArch ---------------------------------------------------------------

    def read_config(self, hf: Any, path: Path) -> ModelArch:
        """`ModelArch` from transformers' config `hf` of the model at `path`; ConfigError for
        what the conversion could not map exactly."""
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        if getattr(hf, "use_sliding_window", False):
            raise ConfigError(f"{path}: sliding-window attention is not supported")
        if hf.hidden_act != "silu":
            raise ConfigError(f"{path}: hidden_act {hf.hidden_act!r} is not supported (silu only)")
        self.check_attention_bias(hf, path)
        return ModelArch(
            model_type=self.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            ffn_hidden_size=hf.intermediate_size,
            rms_eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            tied_embeddings=bool(hf.tie_word_embeddings),
            eagle_draft=self.draft == "eagle",
            has_draft=self.draft is not None,
            **self.read_rope(hf, path),
            **self.read_moe(hf, path),
        )

    def check_attention_bias(self, hf: Any, path: Path) -> None:
        """Refuse `attention_bias` (in these families a bias on o_proj too), unless the family's
        q/k/v bias is what it means."""
        if getattr(hf, "attention_bias", False) and not self.qkv_bias:
            raise ConfigError(f"{path}: attention_bias=true (bias on o_proj) is not supported")

    def read_rope(self, hf: Any, path: Path) -> dict[str, Any]:
        """The rotary embedding's `ModelArch` fields: default rope with `rope_theta` only."""
        rope = rope_parameters(hf)
        if rope.get("rope_type", "default") != "default" or rope.get("rope_theta") is None:
            raise ConfigError(f"{path}: only default rotary embeddings with rope_theta are supported")
        return {"rope_theta": float(rope["rope_theta"])}

    def read_moe(self, hf: Any, path: Path) -> dict[str, Any]:
        """The MoE fields of `ModelArch`; none for a dense family."""
        return {}

    # --- megatron-core --------------------------------------------------------------------------

    def megatron_config(self, arch: ModelArch) -> dict[str, Any]:
        """TransformerConfig arguments beyond the standard decoder's (a router's settings)."""
        return {}

    def megatron_config_class(self) -> type:
        """megatron-core's config class for the family (latent attention has its own)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    def gpt_model_kwargs(self, arch: ModelArch) -> dict[str, Any]:
        """GPTModel arguments beyond the standard decoder's (rope scaling)."""
        return {}

    def finish_model(self, model: Any, arch: ModelArch) -> None:
        """Adjust the built GPTModel `model` where megatron-core's constructor cannot say what
        the family needs (a rotary setting it fixes); nothing by default."""

    def layer_spec(self, arch: ModelArch, config: Any) -> Any:
        """megatron's spec of the decoder layers for TransformerConfig `config`: the local
        (no TransformerEngine) layer spec, with experts and q/k norm as the arch has them."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=arch.num_experts or None,
                                        qk_layernorm=arch.qk_norm, normalization="RMSNorm")  # fmt: skip

    # --- weights: one decoder layer, HF <-> megatron ----------------------------------------

    def layer_to_mcore(
        self, hf: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
        eagle: bool = False, heads: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """Move decoder layer `src` of the HF dict `hf` into `out` under megatron's `dst`
        (`moe`: a layer with routed experts; `eagle`: an EAGLE draft's layer; `heads`: its
        (query, key/value) heads where not the model's)."""
        from agent_rl.families import layout

        layout.layer_in(hf, out, src, dst, arch, moe, eagle=eagle, heads=heads)

    def layer_to_hf(
        self, sd: Weights, out: Weights, src: str, dst: str, arch: ModelArch, moe: bool,
        eagle: bool = False, heads: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """The inverse of `layer_to_mcore`."""
        from agent_rl.families import layout

        layout.layer_out(sd, out, src, dst, arch, moe, eagle=eagle, heads=heads)

    # --- tiny presets ---------------------------------------------------------------------------

    def tiny_config(self, preset: Any, common: dict[str, Any]) -> Any:
        """transformers' config of a tiny model of this family: `common` (what every family's
        tiny config sets, from `preset`) plus the family's own fields."""
        import transformers

        return getattr(transformers, self.config_class)(**common)

    def tiny_config_json(self, preset: Any, config: dict[str, Any]) -> None:
        """Edit the written config.json (`config`) in place for readers other than this
        transformers (SGLang's, older converters)."""

    def model_class(self) -> Any:
        """transformers' model class of the family."""
        import transformers

        return getattr(transformers, self.architecture)


def rope_parameters(hf: Any) -> dict[str, Any]:
    """The rotary settings of transformers' config `hf` (5.x's `rope_parameters`, or 4.x's
    top-level `rope_theta` and `rope_scaling`)."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(hf, "rope_theta", None))
    return rope


def sigmoid_router_moe(arch: ModelArch) -> dict[str, Any]:
    """megatron's MoE settings for a sigmoid router with a score correction bias (frozen: the
    checkpoint's), shared experts and dense first layers, no auxiliary loss, routing replay on:
    what glm4_moe and deepseek_v3 have in common (`Family.megatron_config`)."""
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": arch.moe_shared_ffn_hidden_size or None,
        "moe_layer_freq": [0] * arch.dense_layers + [1] * (arch.num_layers - arch.dense_layers),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_topk_scaling_factor": arch.moe_scaling_factor,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": True,
    }
