"""SGLang's speculative decoding with the model's own MTP draft (`engine.speculative_steps`).

An export of a learner with `trainer.mtp.layers` carries its draft (trainer/hf_convert.py), as
its family says (`Family.draft`, agent_rl.families):
- "mtp" (Qwen3-MoE as `mtp.*` weights; GLM-4.5 and DeepSeek-V3 as their native NextN
  layers): SGLang serves it as the family's `mtp_draft_architecture`
  (`Qwen3MoeForCausalLMMTP`, `Glm4MoeForCausalLMNextN`, `DeepseekV3ForCausalLMNextN`) when
  the same directory is passed as `--speculative-draft-model-path` (its model config rewrites
  the draft's architecture), and
  every `update_weights_from_disk` then loads the target and the draft alike.
- "eagle" (the dense families): as an EAGLE draft in `draft/` (`EAGLE_DRAFT_DIR`: SGLang's
  `Qwen2ForCausalLMEagle`, config and weights), the draft model path. Where the family's target
  skips names it does not know (`Family.eagle_beside_target`: Qwen2) the export also carries the
  draft beside the target's weights, so a disk update reaches the draft too; elsewhere the draft
  follows the policy under the in-memory syncs only.
Either is served under `--speculative-algorithm EAGLE` (NEXTN is an alias of it): a chain
(top-1) of `steps` tokens drafted with its one module, `steps + 1` verified per pass. The
in-memory syncs send the draft its weights with `selector: "draft"` (trainer/weight_sync/memory.py).

Only on a GPU: SGLang 0.5.23 starts no speculative algorithm on the CPU engine (EAGLE needs
sgl-kernel's CUDA kernels for the KV copy and tree verification and an attention backend other
than `torch_native`). `speculative_args` refuses there, and for a model without a draft SGLang
could serve, with one line saying why, before a launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from agent_rl import families
from agent_rl.families.base import EAGLE_DRAFT_ARCHITECTURE, EAGLE_DRAFT_MODEL_TYPE
from agent_rl.kernel.errors import EngineError

__all__ = ["EAGLE_DRAFT_ARCHITECTURE", "EAGLE_DRAFT_DIR", "EAGLE_DRAFT_MODEL_TYPE",
           "speculative_args"]  # fmt: skip

ALGORITHM = "EAGLE"
EAGLE_DRAFT_DIR = "draft"


def speculative_args(model: Path, device: Literal["cpu", "cuda"], steps: int) -> list[str]:
    """`sglang.launch_server` flags serving `model`'s MTP draft `steps` tokens ahead; none for
    `steps` 0. EngineError on CPU or for a model without such a draft."""
    if steps <= 0:
        return []
    if device != "cuda":
        raise EngineError(
            "speculative decoding needs a GPU: SGLang's CPU engine starts no speculative "
            "algorithm (EAGLE needs sgl-kernel's CUDA kernels); start without --speculative here"
        )
    architecture = _architecture(model) or "?"
    family = families.by_architecture(architecture)
    if family is not None and family.draft == "mtp":
        draft = model
        if not _has_draft(model):
            raise EngineError(
                f"{model} has no mtp.* draft weights (nor NextN layers): serve an export of a "
                "learner with trainer.mtp.layers >= 1, or start without --speculative"
            )
    elif family is not None and family.draft == "eagle":
        draft = model / EAGLE_DRAFT_DIR
        if _architecture(draft) != EAGLE_DRAFT_ARCHITECTURE:
            raise EngineError(
                f"{model} has no EAGLE draft in {EAGLE_DRAFT_DIR}/: serve an export of a "
                "learner with trainer.mtp.layers >= 1, or start without --speculative"
            )
    else:
        raise EngineError(
            f"{model} is a {architecture}: agent-rl's drafts are served by SGLang for "
            f"{', '.join(f.architecture for f in families.all_families() if f.draft)} only; "
            "start without --speculative"
        )
    return [
        "--speculative-algorithm", ALGORITHM,
        "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(steps + 1),
    ]  # fmt: skip


def _architecture(model: Path) -> str | None:
    """The first architecture `model/config.json` names; None without one."""
    try:
        return (json.loads((model / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None


def _has_draft(model: Path) -> bool:
    """Whether the safetensors of `model` hold MTP draft tensors, `mtp.*` or native NextN
    layers' (`model.layers.{i}.eh_proj.weight`; read from their headers)."""

    def draft(name: str) -> bool:
        return name.startswith("mtp.") or name.endswith(".eh_proj.weight")

    index = model / "model.safetensors.index.json"
    if index.is_file():
        return any(draft(k) for k in json.loads(index.read_text())["weight_map"])
    for path in model.glob("*.safetensors"):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if any(draft(k) for k in json.loads(f.read(size))):
                return True
    return False
