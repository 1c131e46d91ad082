"""How a model may be split: `Parallel` holds the model-parallel sizes and `check_parallel`
says whether a model can be split that way.

What the network is (`ModelArch.from_hf_dir`) is its family's to say (agent_rl.families);
`ModelArch` is re-exported here for the trainer's modules. Light to import: no torch, no
megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_rl.families import ModelArch
from agent_rl.kernel.errors import ConfigError

__all__ = ["ModelArch", "Parallel", "check_parallel", "draft_heads"]


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
                f"own); SGLang builds a {arch.model_type} model's MTP draft from the model's "
                "config: unset it"
            )
    if mtp_layers and not arch.has_draft:
        raise ConfigError(
            f"{arch.model_type}: trainer.mtp.layers is not supported yet (its MTP layers are not "
            "mapped; agent_rl/families says what each family supports): set it to 0"
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
