"""SGLang's speculative decoding with the model's own MTP draft (`engine.speculative_steps`).

A Qwen3-MoE export of a learner with `trainer.mtp_layers` carries its draft as `mtp.*` weights
(trainer/hf_convert.py). SGLang serves it as `Qwen3MoeForCausalLMMTP` when the same directory
is passed as `--speculative-draft-model-path` (its model config rewrites the draft's
architecture), under `--speculative-algorithm EAGLE` (NEXTN is an alias of it), and every
`update_weights_from_disk` then loads the target and the draft alike, so a weight sync keeps
the draft the trained one. It drafts a chain (top-1) of `steps` tokens with its one module and
verifies `steps + 1` tokens per pass.

Only on a GPU: SGLang 0.5.23 starts no speculative algorithm on the CPU engine (EAGLE needs
sgl-kernel's CUDA kernels for the KV copy and tree verification and an attention backend other
than `torch_native`). `speculative_args` refuses there, and for a model without a draft SGLang
could serve, with one line saying why, before a launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from agent_rl.errors import EngineError

ALGORITHM = "EAGLE"
DRAFT_ARCHITECTURES = {"Qwen3MoeForCausalLM": "Qwen3MoeForCausalLMMTP"}
"""Target architectures whose `mtp.*` draft SGLang serves from the target's own directory."""


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
    config = json.loads((model / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in DRAFT_ARCHITECTURES:
        raise EngineError(
            f"{model} is a {architecture}: agent-rl's mtp.* draft is served by SGLang for "
            f"{', '.join(DRAFT_ARCHITECTURES)} only (a dense model would need an EAGLE-format "
            "draft, not built yet); start without --speculative"
        )
    if not _has_draft(model):
        raise EngineError(
            f"{model} has no mtp.* draft weights: serve an export of a learner with "
            "trainer.mtp_layers >= 1, or start without --speculative"
        )
    return [
        "--speculative-algorithm", ALGORITHM,
        "--speculative-draft-model-path", str(model),
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(steps + 1),
    ]  # fmt: skip


def _has_draft(model: Path) -> bool:
    """Whether the safetensors of `model` hold `mtp.*` tensors (read from their headers)."""
    index = model / "model.safetensors.index.json"
    if index.is_file():
        return any(k.startswith("mtp.") for k in json.loads(index.read_text())["weight_map"])
    for path in model.glob("*.safetensors"):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if any(k.startswith("mtp.") for k in json.loads(f.read(size))):
                return True
    return False
