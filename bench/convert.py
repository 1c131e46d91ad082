"""HF -> Megatron load and Megatron -> HF export of a ~1B model, against raw safetensors I/O.

The model (`--family`, `CONFIGS`) is, by default, Llama-3.2-1B's own config (the `llama`
family: hidden 2048, 16 layers, 32 query and 8 key/value heads, MLP 8192, vocabulary 128256,
tied embeddings, llama3 rope scaling; 1.24B parameters); `--family deepseek_v3` a 1B-class
model of DeepSeek-V3's shape (its config with the sizes scaled down: multi-head latent attention
with q/kv LoRA ranks and decoupled rope, YaRN, a dense first layer, then 40 routed experts in 8
groups, top-8 from the best 4, and a shared one; its vocabulary, untied; 1.02B parameters, most
of them in 440 per-expert MLPs). Random bf16 weights, written as transformers writes a big
checkpoint: `model-0000i-of-0000n.safetensors` shards of about 500 MB and their index. bf16
because the machine this runs on is shared and small: one copy of the model is 2.0-2.5 GB.

Each phase runs in a process of its own, so one phase's allocations do not count in the next's
peak RSS (the process's own `ru_maxrss` after the phase's first run):
- raw read: `safe_open` every shard and `get_tensor` every tensor, cloned and all kept (the
  library maps the file: without the clone nothing would be read), the bytes the load must read;
- raw write: the same tensors (read untimed first) written back with `save_file`, shard by
  shard (the bytes the export must write);
- load: the learner's path in one CPU process with gloo, as the trainer runs it: megatron-core
  builds the bf16 model (`build_gpt_model` without megatron's initialisation, which the load
  would overwrite: the learner's build for a load that fills every weight; untimed), then
  `load_hf_weights` is timed;
- export: the model built the same way, every weight then written (constant values: the export
  does not care, but a trained model's pages are all in memory), then what
  `Learner.export_hf` does is timed (`gather_full_state_dict`, `mcore_to_hf`, `write_hf_dir`).
The optimizer is left out: its fp32 master weights and Adam state (16 bytes a parameter) do not
fit this machine at this size, and conversion does not touch them.

Each timed part runs REPEATS times in its process and the best time counts (the first run of a
phase also pays for the page cache the machine's other users took). GB/s is the model's bytes
over the timed seconds; each ratio is the learner's GB/s over the raw
one of the same direction. `peak_rss_over_model` is the larger of the load and export phases'
peak RSS over the model's bytes; the processes' RSS after their imports (torch, megatron-core:
no model yet; for load and export, after the model is built, its pages untouched for load) is
reported beside it as `import_rss_gb`, and the most the conversion adds above it and the
model's own bytes as `conversion_rss_over_model`. The shards were just written, so reads
come from the page cache in every phase alike.

Run: `python bench/convert.py [--family deepseek_v3]` (about 2-3 minutes on 2 cores; needs ~8 GB
free memory and ~8 GB of temporary disk). Last line: RESULT {"family", "load_ratio", "export_ratio",
"peak_rss_over_model", "conversion_rss_over_model", "gb_s": {...}, "seconds": {...}, "peak_rss_gb": {...}, "model_gb",
"params", "load_avg_1m", "wall_s"}.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B), as published.
LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3) with its sizes scaled to ~1B parameters:
# hidden 7168 -> 1024, 61 layers (3 dense) -> 12 (1 dense), 128 heads -> 16, q/kv ranks
# 1536/512 -> 384/256, head dims 128/64/128 -> 64/32/64, 256 experts of 2048 -> 40 of 512 (8
# groups, top-8 from the best 4 as published), no NextN layer; routing, YaRN and norms as published.
DEEPSEEK_V3_1B: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 2816, "kv_lora_rank": 256,
    "max_position_embeddings": 163840, "moe_intermediate_size": 512, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 40, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts_per_tok": 8, "num_hidden_layers": 12,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": 384,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 64, "vocab_size": 129280,
}  # fmt: skip
CONFIGS = {"llama": LLAMA_3_2_1B, "deepseek_v3": DEEPSEEK_V3_1B}
SHARD_BYTES = 500 * 2**20
REPEATS = 3  # each phase's timed part, best of: a busy machine's timings scatter 2-5x


def shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF weight names and shapes of `config` as a checkpoint stores them, from transformers'
    own model class on the meta device (tied embeddings: no `lm_head.weight`), its in-memory
    layout turned back into the checkpoint's (`revert_weight_conversion`: transformers 5 fuses
    a MoE layer's experts into one tensor, a checkpoint has one per expert and projection)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    stored = revert_weight_conversion(model, model.state_dict())
    return {n: tuple(t.shape) for n, t in stored.items()
            if not (hf_config.tie_word_embeddings and n == "lm_head.weight")}  # fmt: skip


def make(model: Path, family: str) -> None:
    """Random bf16 weights of `CONFIGS[family]` in shards of about SHARD_BYTES, one shard in
    memory at a time."""
    import torch
    from safetensors.torch import save_file

    config = CONFIGS[family]
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes(config).items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in group}
        save_file(tensors, str(model / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: fname for n in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _read_all(model: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                # get_tensor maps the file; the clone reads its bytes into memory of our own
                out[key] = handle.get_tensor(key).clone()
    return out


def _build(model: Path, resident: bool) -> tuple[Any, Any]:
    """The bf16 model as the learner builds it for a load that fills every weight (megatron's
    initialisation skipped); `resident`: with every weight then written once (bf16 values in
    place), as a trained model's are in memory when it exports."""
    import torch

    from trainer import dist_env
    from trainer.arch import ModelArch, Parallel
    from trainer.model import build_gpt_model

    arch = ModelArch.from_hf_dir(model)
    dist_env.init(Parallel(1, 1, 1))
    module = build_gpt_model(arch, Parallel(1, 1, 1), torch.bfloat16, initialize=False)
    if resident:
        with torch.no_grad():
            for param in module.parameters():
                param.fill_(0.02)
    return module, arch


def phase(name: str, model: Path, scratch: Path) -> dict[str, float]:
    """One phase in this (child) process: its best timed seconds, the RSS after its imports
    and its peak RSS by the end of its first run (later runs' replace what the first made,
    briefly holding both of one tensor)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    peak: float | None = None
    if name == "raw_read":
        imported = _rss_gb()
        seconds = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            tensors = _read_all(model)
            seconds = min(seconds, time.perf_counter() - t0)
            del tensors
            peak = peak or _rss_gb()
    elif name == "raw_write":
        from safetensors.torch import save_file

        imported = _rss_gb()
        from safetensors import safe_open

        files = sorted(model.glob("*.safetensors"))
        seconds = 0.0
        for f in files:  # shard by shard, as written: only the write is timed
            with safe_open(str(f), "pt") as handle:
                tensors = {k: handle.get_tensor(k).clone() for k in handle.keys()}  # noqa: SIM118
            best = float("inf")
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                save_file(tensors, str(scratch / f.name), metadata={"format": "pt"})
                best = min(best, time.perf_counter() - t0)
            seconds += best
            del tensors
            peak = max(peak or 0.0, _rss_gb())
    elif name == "load":
        from trainer.learner import load_hf_weights

        module, arch = _build(model, resident=False)
        import trainer.hf_convert  # noqa: F401 (imported before the baseline)

        imported = _rss_gb()
        seconds = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            load_hf_weights(module, arch, model)
            seconds = min(seconds, time.perf_counter() - t0)
            peak = peak or _rss_gb()
    elif name == "export":
        from trainer import hf_convert, shard

        module, arch = _build(model, resident=True)
        imported = _rss_gb()
        seconds = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            full = shard.gather_full_state_dict(module, arch, copy=False)
            hf_convert.write_hf_dir(hf_convert.mcore_to_hf(full, arch), scratch, model)
            seconds = min(seconds, time.perf_counter() - t0)
            del full
            peak = peak or _rss_gb()
    else:
        raise SystemExit(f"unknown phase {name!r}: raw_read, raw_write, load or export")
    return {"seconds": seconds, "rss_before_gb": imported, "peak_rss_gb": peak or _rss_gb()}


def run_phase(name: str, model: Path, scratch: Path) -> dict[str, float]:
    """`phase` in a fresh process, which reports its own peak RSS as it ends."""
    scratch.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, __file__, "--phase", name, str(model), str(scratch)],
                          check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(family: str) -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, __file__, "--make", str(model), family], check=True,
                       timeout=300)  # fmt: skip
        model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        params = model_bytes // 2  # bf16 (the headers make this a few kB high)
        gb = model_bytes / 1e9
        print(f"model: {gb:.2f} GB of bf16 safetensors in "
              f"{len(list(model.glob('*.safetensors')))} shards", flush=True)
        res = {}
        for name in ("raw_read", "raw_write", "load", "export"):
            res[name] = run_phase(name, model, Path(tmp) / f"out-{name}")
            print(f"{name}: {res[name]['seconds']:.2f} s, {gb / res[name]['seconds']:.2f} GB/s, "
                  f"peak RSS {res[name]['peak_rss_gb']:.2f} GiB "
                  f"(after imports {res[name]['rss_before_gb']:.2f})", flush=True)
            import shutil

            shutil.rmtree(Path(tmp) / f"out-{name}", ignore_errors=True)
    gb_s = {k: gb / v["seconds"] for k, v in res.items()}
    model_gib = model_bytes / 2**30
    result = {
        "family": family,
        "load_ratio": round(gb_s["load"] / gb_s["raw_read"], 3),
        "export_ratio": round(gb_s["export"] / gb_s["raw_write"], 3),
        "peak_rss_over_model": round(
            max(res["load"]["peak_rss_gb"], res["export"]["peak_rss_gb"]) / model_gib, 3),
        # What the conversion itself adds above the imports and the model's own bytes (the load
        # phase's build leaves the model's pages untouched: its rise includes the model).
        "conversion_rss_over_model": round(max(
            res["load"]["peak_rss_gb"] - res["load"]["rss_before_gb"] - model_gib,
            res["export"]["peak_rss_gb"] - res["export"]["rss_before_gb"],
        ) / model_gib, 3),
        "gb_s": {k: round(v, 3) for k, v in gb_s.items()},
        "seconds": {k: round(v["seconds"], 2) for k, v in res.items()},
        "peak_rss_gb": {k: round(v["peak_rss_gb"] * 2**30 / 1e9, 2) for k, v in res.items()},
        "import_rss_gb": {k: round(v["rss_before_gb"] * 2**30 / 1e9, 2) for k, v in res.items()},
        "model_gb": round(gb, 3),
        "params": params,
        "dtype": "bf16",
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["--phase"]:
        print(json.dumps(phase(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))))
    else:
        args = sys.argv[1:]
        if args not in ([], ["--family", "llama"], ["--family", "deepseek_v3"]):
            raise SystemExit(f"usage: python bench/convert.py [--family {{{','.join(CONFIGS)}}}]")
        main(args[1] if args else "llama")
