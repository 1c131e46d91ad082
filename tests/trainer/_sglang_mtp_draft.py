"""Run by the engine environment's python (not the main venv's): build SGLang's own Qwen3-MoE MTP
draft (`Qwen3MoeForCausalLMMTP`) for the model directory argv[1], fill its parameters with NaN,
load argv[1]'s safetensors through the draft's own `load_weights`, and save its parameters as
they then are to argv[2] (a safetensors file). A parameter the loader did not fill stays NaN.

One CPU process, a gloo world of one; nothing is served."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig


def main(model_dir: str, out: str) -> None:
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

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
    from sglang.srt.models.qwen3_moe_mtp import Qwen3MoeForCausalLMMTP

    draft = Qwen3MoeForCausalLMMTP(AutoConfig.from_pretrained(model_dir))
    with torch.no_grad():
        for param in draft.parameters():
            param.fill_(float("nan"))

    def weights():
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield key, handle.get_tensor(key)

    draft.load_weights(weights())
    save_file({n: p.detach().contiguous() for n, p in draft.named_parameters()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
