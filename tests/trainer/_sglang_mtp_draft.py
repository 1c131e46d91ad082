"""Run by the engine environment's python (not the main venv's): build SGLang's own draft for
the export argv[1] (a Qwen3-MoE's `Qwen3MoeForCausalLMMTP`, from argv[1]'s config; with a
`draft/` directory, a dense model's `Qwen2ForCausalLMEagle`, from its config), fill its
parameters with NaN, load weights into it through the draft's own `load_weights`, and save its
parameters as they then are under the directory argv[2]. A parameter the loader did not fill
stays NaN.

- `disk.safetensors`: loaded from argv[1]'s safetensors (what `update_weights_from_disk` loads
  into target and draft alike, and a Qwen3-MoE launch loads);
- `launch.safetensors` (EAGLE): loaded from `draft/` (what `--speculative-draft-model-path`
  loads at launch); and `target.safetensors`: SGLang's target model (`Qwen2ForCausalLM`,
  `Qwen3ForCausalLM`) loaded from argv[1], which must skip the draft's weights beside its own;
- a model with native NextN layers (GLM-4.5's `Glm4MoeForCausalLM`, DeepSeek-V3's): its draft is
  SGLang's NextN class (`Glm4MoeForCausalLMNextN`, `DeepseekV3ForCausalLMNextN`), loaded from
  argv[1] as a launch loads it from the target's directory (`disk.safetensors`), and
  `target.safetensors` is SGLang's target on the same files, which must skip the NextN layer;
- with argv[3], a `torch.save`d {"distributed": [...], "tensor": [...]} of the buckets an
  in-memory weight sync sends the draft: `distributed.safetensors`, each bucket's bytes received
  into SGLang's own receive bucket (`FlattenedTensorBucket.empty` from the names, dtypes and
  shapes) and `tensor.safetensors`, each shared bucket read through SGLang's metadata, both
  reconstructed and loaded as the draft's model runner does.

One CPU process, a gloo world of one; nothing is served."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig


def main(model_dir: str, out: str, buckets: str | None) -> None:
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    args = ServerArgs(model_path=model_dir, device="cpu", attention_backend="torch_native",
                      sampling_backend="pytorch", dtype="float32")  # fmt: skip
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
    initialize_model_parallel()
    initialize_moe_config()
    eagle = (Path(model_dir) / "draft" / "config.json").is_file()
    architecture = AutoConfig.from_pretrained(model_dir).architectures[0]
    nextn = architecture in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
    if nextn:
        from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
        from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
        from sglang.srt.models.glm4_moe_nextn import Glm4MoeForCausalLMNextN

        target, Draft = {  # noqa: N806 (a class)
            "Glm4MoeForCausalLM": (Glm4MoeForCausalLM, Glm4MoeForCausalLMNextN),
            "DeepseekV3ForCausalLM": (DeepseekV3ForCausalLM, DeepseekV3ForCausalLMNextN),
        }[architecture]
        config = target_config = AutoConfig.from_pretrained(model_dir)
    elif eagle:
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM
        from sglang.srt.models.qwen2_eagle import Qwen2ForCausalLMEagle as Draft
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM

        targets = {"Qwen2ForCausalLM": Qwen2ForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}
        target_config = AutoConfig.from_pretrained(model_dir)
        target = targets[target_config.architectures[0]]
        config = AutoConfig.from_pretrained(str(Path(model_dir) / "draft"))
    else:
        from sglang.srt.models.qwen3_moe_mtp import Qwen3MoeForCausalLMMTP as Draft

        config = AutoConfig.from_pretrained(model_dir)

    def load(name: str, parts: list[list[tuple[str, torch.Tensor]]], model: type = Draft,
             model_config: Any = None) -> None:  # fmt: skip
        draft = model(model_config or config)
        with torch.no_grad():
            for param in draft.parameters():
                param.fill_(float("nan"))
        for named in parts:
            draft.load_weights(named)
        params = {n: p.detach().contiguous() for n, p in draft.named_parameters()}
        save_file(params, str(Path(out) / f"{name}.safetensors"))

    def disk(directory: str = model_dir) -> list[tuple[str, torch.Tensor]]:
        named = []
        for f in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(f), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    named.append((key, handle.get_tensor(key)))
        return named

    load("disk", [disk()])
    if nextn:
        load("target", [disk()], target, target_config)
    if eagle:
        load("launch", [disk(str(Path(model_dir) / "draft"))])
        load("target", [disk()], target, target_config)
    if buckets is None:
        return
    sent = torch.load(buckets)
    received = []
    for b in sent["distributed"]:
        bucket = FlattenedTensorBucket.empty(b["names"], b["dtypes"], b["shapes"], "cpu")
        bucket.get_flattened_tensor().copy_(b["flat"])  # what the broadcast writes there
        received.append(bucket.reconstruct_tensors())
    load("distributed", received)
    shared = []
    for b in sent["tensor"]:
        metadata = [FlattenedTensorMetadata(**m) for m in b["metadata"]]
        bucket = FlattenedTensorBucket(flattened_tensor=b["flat"], metadata=metadata)
        shared.append(bucket.reconstruct_tensors())
    load("tensor", shared)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
