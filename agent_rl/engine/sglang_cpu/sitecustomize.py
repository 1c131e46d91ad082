"""CPU compatibility layer for SGLang 0.5.23, applied at launch in every engine process.

The launcher puts this directory first on the engine's PYTHONPATH, so Python imports this
`sitecustomize` at interpreter start-up in the server process; SGLang's scheduler and detokenizer
are forked from it, patches applied (shim 8), or import it too when spawned. No installed file is
edited; nothing heavy is imported here: the patches wait in import hooks until SGLang imports the
module they fix. On a GPU host the launcher does not put this directory on the path at all.

The shims (each shown necessary on a CPU-only host, see docs/engine.md):
1. `sgl_kernel`: its CPU build is not on PyPI, yet with SGLANG_USE_CPU_ENGINE=1 SGLang imports
   names from it. An import-only stand-in module is served when no real package is installed;
   every attribute raises when *called*, so a path that truly needs a kernel fails loudly. It
   registers no torch ops, so SGLang's `cpu_has_amx_support()` is False and it takes its native
   torch paths.
2. `--enable-return-routed-experts` allocates its host buffer with `cudaHostRegister`
   (`sglang.srt.mem_cache.pool_host.common._cuda_host_register`), which fails without CUDA:
   wrapped into a no-op when CUDA is unavailable.
3. torchvision: a wheel whose C++ ops cannot load beside the installed torch dies at import on
   `register_fake("torchvision::nms")`. While `torchvision._meta_registrations` executes, such
   registrations are skipped if the ops are missing. With the pinned pair this is a no-op.
4. per-request sampling seeds: SGLang honours `sampling_params.sampling_seed` only under
   `--enable-deterministic-inference`, which refuses the CPU attention backend (torch_native)
   and switches on batch-invariant kernels written in Triton. Its seeded sampler itself
   (`multinomial_with_seed`: Gumbel-max over a MurmurHash3 of seed, position and token) needs
   only its hash, which on CPU is an sgl_kernel op: it is replaced by the same function in
   plain torch (not torch.compile'd), and a batch holding a seeded request gets a seed for every
   row: the request's own, or for an unseeded request one drawn at random once (its sampling
   stays random). Batches without a seeded request sample exactly as before. `agent-rl eval`
   relies on this for reruns that give the same tokens.
5. attention of the CPU backend (`torch_native`): SGLang's loop over requests indexed the KV
   cache with a tensor for every request and layer, and a prefill attended a query of the whole
   sequence, its cached prefix included, keeping only the new rows. Here the requests' slots
   are read once per forward pass (not once per request and layer), each request's keys and
   values are gathered with index_select, the outputs written back in one copy, and a prefill
   attends its new rows only (causal from their own positions). Still one request at a
   time, so a request's result does not depend on its batch (bit for bit; seeded sampling relies
   on it); decode equals SGLang's bit for bit, prefill to float rounding. Sliding windows and
   encoder attention keep SGLang's own. AGENT_RL_ENGINE_FAST_ATTENTION=0 turns this one off.
6. latent attention (DeepSeek-V2/V3 and their kin) on the CPU backend: with no handler of its
   own, `torch_native` took the Triton one, which runs a prefill through the model's MHA path
   (per-head keys and values handed to the backend with `save_kv_cache=False`); the CPU
   backend attends what the KV cache holds, which for MLA is the latent, so the widths
   disagree and the engine dies on its first request. Registered for `torch_native`: the
   absorbed MLA path for every forward (queries against the cached latent, which is what the
   cache holds), as SGLang's deterministic mode chooses on the GPU backends.
7. start-up: SGLang's model registry imports every module under sglang/srt/models (~250) when
   the scheduler starts, to serve one architecture: 1.2 s of the scheduler's CPU here. Only the
   modules whose source names an architecture in `--model-path`'s config.json are imported
   (SGLang's own SGLANG_DISABLED_MODEL_ARCHS, set for that import alone); the registry is left
   marked as not holding its defaults, so any other architecture asked of it imports them all,
   as before. The model class served is the same one.
8. start-up: SGLang spawns its scheduler and detokenizer (multiprocessing "spawn", which CUDA
   needs), and each fresh interpreter imported torch, transformers and SGLang again, most of an
   engine start's CPU. On CPU they are forked from the server, which has imported all of it by
   then (one thread, no CUDA, no OpenMP pool yet); a forked child's SIGQUIT is reset to the
   default a spawned one has. SGLang's crash signalling is unchanged: a child's parent is still
   the server. AGENT_RL_ENGINE_FORK=0 turns this one off.

AGENT_RL_ENGINE_COMPAT=0 disables everything; AGENT_RL_ENGINE_COMPAT_VERBOSE=1 logs to stderr.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

_ENABLED = os.environ.get("AGENT_RL_ENGINE_COMPAT", "1") != "0"
_VERBOSE = os.environ.get("AGENT_RL_ENGINE_COMPAT_VERBOSE", "0") == "1"


def _log(msg: str) -> None:
    if _VERBOSE:
        sys.stderr.write(f"[agent-rl engine compat pid={os.getpid()}] {msg}\n")


def _warn(msg: str) -> None:
    sys.stderr.write(f"[agent-rl engine compat] WARNING: {msg}\n")


# --- 2. no cudaHostRegister without CUDA ---------------------------------------------------------
def _patch_pool_host_common(module: types.ModuleType) -> None:
    import torch

    if torch.cuda.is_available():
        return
    original = getattr(module, "_cuda_host_register", None)
    if original is None:
        _warn(
            "sglang.srt.mem_cache.pool_host.common._cuda_host_register not found (SGLang version "
            "drift?); --enable-return-routed-experts may fail on CPU"
        )
        return

    def _cuda_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
        # No CUDA runtime: the buffer stays ordinary pageable memory, as pin_memory=False would.
        return None

    module._cuda_host_register = _cuda_host_register
    _log("pool_host.common._cuda_host_register is a no-op without CUDA")


# --- 3. torchvision fake ops without its C++ ops -------------------------------------------------
def _around_torchvision_meta_registrations(
    module: types.ModuleType, run: Callable[[], None]
) -> None:
    import torch.library
    import torchvision.extension

    if torchvision.extension._has_ops():
        run()
        return
    original = torch.library.register_fake

    def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.startswith("torchvision::"):
            _log(f"torchvision C++ ops unavailable: skipping register_fake({op!r})")
            func = args[0] if args and callable(args[0]) else kwargs.get("func")
            return func if func is not None else (lambda f: f)
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        run()
    finally:
        torch.library.register_fake = original


# --- 4. per-request sampling seeds without deterministic inference -------------------------------
def _patch_sampling_batch_info(module: types.ModuleType) -> None:
    import random

    import torch

    info_cls = getattr(module, "SamplingBatchInfo", None)
    if info_cls is None or not hasattr(info_cls, "from_schedule_batch"):
        _warn("SamplingBatchInfo.from_schedule_batch not found (SGLang version drift?); "
              "per-request sampling seeds are ignored on CPU")
        return
    build, merge = info_cls.from_schedule_batch.__func__, info_cls.merge_batch

    def seed_of(req: Any) -> int:
        seed = req.sampling_params.sampling_seed
        if seed is None:
            seed = getattr(req, "_agent_rl_seed", None)
            if seed is None:
                seed = req._agent_rl_seed = random.getrandbits(62)
        return int(seed)

    def from_schedule_batch(cls: Any, batch: Any, vocab_size: int) -> Any:
        info = build(cls, batch, vocab_size)
        if info.sampling_seed is None and any(
            r.sampling_params.sampling_seed is not None for r in batch.reqs
        ):
            info.sampling_seed = torch.tensor([seed_of(r) for r in batch.reqs],
                                              dtype=torch.int64, device=info.temperatures.device)
        return info

    def merge_batch(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
        # One side seeded, the other not: the unseeded side's rows get random seeds, so the
        # merged batch keeps a seed for every row.
        if (self.sampling_seed is None) != (other.sampling_seed is None):
            for side in (self, other):
                if side.sampling_seed is None:
                    side.sampling_seed = torch.tensor(
                        [random.getrandbits(62) for _ in range(len(side))], dtype=torch.int64,
                        device=side.temperatures.device)
        return merge(self, other, *args, **kwargs)

    info_cls.from_schedule_batch = classmethod(from_schedule_batch)
    info_cls.merge_batch = merge_batch
    _log("sampling_batch_info: per-request sampling seeds honoured without deterministic mode")


_M32 = 0xFFFFFFFF


def _murmur_hash32(seed: Any, positions: Any, cols: Any) -> Any:
    """MurmurHash3 (x86, 32-bit) of the 16 bytes seed (low, high), position, column, as SGLang's
    Triton kernel computes it; int64 arithmetic masked to 32 bits (products wrap mod 2**64,
    which keeps their low 32 bits)."""
    import torch

    def rotl(x: Any, r: int) -> Any:
        return ((x << r) | (x >> (32 - r))) & _M32

    def mix(h: Any, k: Any) -> Any:
        k = rotl((k * 0xCC9E2D51) & _M32, 15)
        k = (k * 0x1B873593) & _M32
        h = rotl(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & _M32

    s = seed.to(torch.int64)
    h = torch.zeros_like(s)
    h = mix(h, s & _M32)
    h = mix(h, (s >> 32) & _M32)
    h = mix(h, positions.to(torch.int64) & _M32)
    h = mix(h[:, None], cols.to(torch.int64)[None, :]) ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _patch_sampler(module: types.ModuleType) -> None:
    import torch

    if torch.cuda.is_available() or not hasattr(module, "multinomial_with_seed"):
        return

    def multinomial_with_seed(logprobs: Any, seed: Any, positions: Any) -> Any:
        n, m = logprobs.shape
        hashed = _murmur_hash32(seed, positions, torch.arange(m))
        x = hashed.to(torch.float64) / float(_M32)
        x = x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0**-32)).neg_()
        x = x.log_().neg_()  # Gumbel noise
        return torch.argmax(x.add_(logprobs.to(torch.float64)), dim=1, keepdim=True)

    module.multinomial_with_seed = multinomial_with_seed
    _log("sampler.multinomial_with_seed: MurmurHash3 in plain torch on CPU")


# --- 5. attention: the KV cache read with index_select, prefill of new rows only ----------------
def _patch_torch_native_backend(module: types.ModuleType) -> None:
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    backend = getattr(module, "TorchNativeAttnBackend", None)
    if backend is None or not hasattr(backend, "_run_sdpa_forward_decode"):
        _warn("TorchNativeAttnBackend._run_sdpa_forward_decode not found (SGLang version drift?); "
              "attention runs SGLang's own loop")
        return
    decode_s = backend._run_sdpa_forward_decode
    extend_s = getattr(backend, "_run_sdpa_forward_extend", None)

    def sglang_s_only(encoder_lens: Any, is_cross_attn: bool, sliding_window_size: Any) -> bool:
        """Encoder and sliding-window attention: SGLang's own loop."""
        return (encoder_lens is not None or is_cross_attn
                or (sliding_window_size is not None and sliding_window_size > -1))

    def request_slots(self: Any, req_to_token: Any, req_pool_indices: Any,
                      seq_lens: Any) -> tuple[list[int], Any]:
        """Each request's KV-cache slots, read from req_to_token in one gather, once per forward
        pass: every layer of a pass attends the same slots (init_forward_metadata forgets
        them). Kept with the tensors they were read from and the lengths, and read again if
        any differs, so a pass whose metadata was planned elsewhere still gets its own."""
        lengths, rows = seq_lens.tolist(), req_pool_indices.tolist()
        kept = getattr(self, "_agent_rl_slots", None)
        if (kept is not None and kept[0] is req_to_token and kept[1] is req_pool_indices
                and kept[2] is seq_lens and kept[3] == lengths and kept[4] == rows):
            return lengths, kept[5]
        longest = max(lengths, default=0)
        table = req_to_token.index_select(0, req_pool_indices)[:, :longest]
        slots = table[torch.arange(longest, device=table.device)[None, :] < seq_lens[:, None]]
        per_request = slots.split(lengths)
        self._agent_rl_slots = (req_to_token, req_pool_indices, seq_lens, lengths, rows,
                                per_request)
        return lengths, per_request

    def attend_each(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
                    req_to_token: Any, req_pool_indices: Any, seq_lens: Any,
                    prefix_lens: list[int], new_lens: list[int], causal: bool, scaling: Any,
                    enable_gqa: bool) -> Any:
        """Each request's new rows of `query` (a decode step: one) attend its keys, one request
        at a time as in SGLang's loop (so a request's result does not depend on its batch), its
        keys and values gathered by index_select from its slots (`request_slots`), and every
        request's output written back in one copy. SGLang's loop read the slots and indexed the
        KV cache with a tensor per request and layer, and its extend attended a query of the
        whole sequence, its cached prefix included, and kept the new rows: a turn appended to a
        long conversation cost the conversation's length squared. (Gathering every request's
        keys at once instead was slower from 1k tokens on: the batch's keys leave the cache
        before their request attends them.)"""
        lengths, slots = request_slots(self, req_to_token, req_pool_indices, seq_lens)
        if not lengths:
            return output
        total = sum(new_lens)
        queries = query[:total].transpose(0, 1).split(new_lens, dim=1)  # [heads, new, size]
        outputs = []
        for rows, own_slots, length, prefix, new in zip(queries, slots, lengths, prefix_lens,
                                                        new_lens):
            key = k_cache.index_select(0, own_slots).transpose(0, 1)  # [kv heads, len, size]
            value = v_cache.index_select(0, own_slots).transpose(0, 1)
            if not (rows.dtype == key.dtype == value.dtype):
                key, value = key.to(rows.dtype), value.to(rows.dtype)
            mask, is_causal = None, False
            if causal and prefix == 0:
                is_causal = new > 1
            elif causal and new > 1:  # each new row sees the keys up to its own position
                positions = torch.arange(prefix, length, device=key.device)
                mask = torch.arange(length, device=key.device)[None, :] <= positions[:, None]
            outputs.append(scaled_dot_product_attention(
                rows, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling,
                enable_gqa=enable_gqa))
        output[:total] = torch.cat(outputs, dim=1).transpose(0, 1)
        return output

    def _run_sdpa_forward_decode(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
                                 req_to_token: Any, req_pool_indices: Any, seq_lens: Any,
                                 encoder_lens: Any = None, scaling: Any = None,
                                 enable_gqa: bool = False, causal: bool = False,
                                 is_cross_attn: bool = False,
                                 sliding_window_size: Any = None) -> Any:
        n = seq_lens.shape[0]
        if query.shape[0] != n or causal or sglang_s_only(encoder_lens, is_cross_attn,
                                                          sliding_window_size):
            return decode_s(self, query, output, k_cache, v_cache, req_to_token,
                            req_pool_indices, seq_lens, encoder_lens, scaling=scaling,
                            enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                            sliding_window_size=sliding_window_size)
        return attend_each(self, query, output, k_cache, v_cache, req_to_token,
                           req_pool_indices, seq_lens, [0] * n, [1] * n, False, scaling,
                           enable_gqa)

    def _run_sdpa_forward_extend(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any,
                                 req_to_token: Any, req_pool_indices: Any, seq_lens: Any,
                                 extend_prefix_lens: Any, extend_seq_lens: Any,
                                 encoder_lens: Any = None, scaling: Any = None,
                                 enable_gqa: bool = False, causal: bool = False,
                                 is_cross_attn: bool = False,
                                 sliding_window_size: Any = None) -> Any:
        if sglang_s_only(encoder_lens, is_cross_attn, sliding_window_size):
            return extend_s(self, query, output, k_cache, v_cache, req_to_token,
                            req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                            encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                            is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        return attend_each(self, query, output, k_cache, v_cache, req_to_token,
                           req_pool_indices, seq_lens, extend_prefix_lens.tolist(),
                           extend_seq_lens.tolist(), causal, scaling, enable_gqa)

    init_forward_metadata = backend.init_forward_metadata

    def init_forward_metadata_forgetting_slots(self: Any, forward_batch: Any) -> None:
        self._agent_rl_slots = None
        init_forward_metadata(self, forward_batch)

    backend.init_forward_metadata = init_forward_metadata_forgetting_slots
    backend._run_sdpa_forward_decode = _run_sdpa_forward_decode
    if extend_s is not None:
        backend._run_sdpa_forward_extend = _run_sdpa_forward_extend
    _log("torch_native_backend: attention reads the KV cache with index_select; a prefill "
         "attends its new tokens only")


# --- 6. latent attention's forward method on the CPU backend --------------------------------------
def _patch_latent_attention_handler(module: types.ModuleType) -> None:
    registry = getattr(module, "AttentionBackendRegistry", None)
    dispatch = getattr(module, "_dispatch_mla_subtype", None)
    if registry is None or dispatch is None:
        _warn("deepseek_common.attention_backend_handler drifted (SGLang version?); latent "
              "attention on torch_native takes the MHA path, which reads the wrong cache")
        return
    registry.register("torch_native", dispatch)
    _log("latent attention on torch_native: the absorbed MLA path for every forward")


# --- 7. the model registry imports the served architecture's modules only -----------------------
_DISABLED_ARCHS = "SGLANG_DISABLED_MODEL_ARCHS"


def _served_architectures() -> list[str]:
    """The architectures config.json names for this process's `--model-path` (a spawned child's
    sys.argv is its server's); none when there is no such local file."""
    argv, path = sys.argv, None
    for i, arg in enumerate(argv):
        if arg == "--model-path" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--model-path="):
            path = arg.partition("=")[2]
    if path is None:
        return []
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [a for a in archs if isinstance(a, str) and a.isidentifier()]


def _around_model_registry(module: types.ModuleType, run: Callable[[], None]) -> None:
    """SGLang's registry imports every module under sglang/srt/models at import (1.2 s of the
    scheduler's CPU here, ~270 architectures) to serve one. Those whose source never names the
    served architectures are skipped through SGLang's own SGLANG_DISABLED_MODEL_ARCHS for that
    import only; the registry is then marked as not holding its defaults, with its cache
    cleared, so any other architecture asked of it (a fallback, a multimodal part, a plugin's
    registration, the list of supported ones) imports all of them as before."""
    package = sys.modules.get("sglang.srt.models")
    archs = _served_architectures()
    if (not archs or package is None or os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
            or os.environ.get(_DISABLED_ARCHS)):
        run()
        return
    try:
        with open(module.__spec__.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            registry_source = f.read()
    except (AttributeError, TypeError, OSError):
        registry_source = ""
    if not all(name in registry_source for name in (
            "_default_models_loaded", "def import_model_classes", _DISABLED_ARCHS)):
        _warn("sglang.srt.models.registry drifted (SGLang version?); it imports every model")
        run()
        return
    import pkgutil
    import re

    named = re.compile(r"\b(?:" + "|".join(map(re.escape, archs)) + r")\b")
    skipped = []
    for found in pkgutil.iter_modules(package.__path__):
        if found.ispkg:
            continue
        source = os.path.join(getattr(found.module_finder, "path", ""), found.name + ".py")
        try:
            with open(source, encoding="utf-8", errors="replace") as f:
                if named.search(f.read()):
                    continue
        except OSError:
            continue  # not a plain source file: imported as before
        skipped.append(found.name)
    os.environ[_DISABLED_ARCHS] = ",".join(skipped)
    try:
        run()
    finally:
        del os.environ[_DISABLED_ARCHS]
    module.import_model_classes.cache_clear()
    module.ModelRegistry._default_models_loaded = False
    _log(f"model registry: imported the modules naming {archs} only "
         f"({len(skipped)} others wait until asked for)")


# --- 8. SGLang's children forked from the server, not spawned -----------------------------------
def _patch_engine_start_method(module: types.ModuleType) -> None:
    set_envs_and_config = module._set_envs_and_config

    def then_fork(*args: Any, **kwargs: Any) -> Any:
        result = set_envs_and_config(*args, **kwargs)  # sets "spawn" for CUDA's sake
        import multiprocessing
        import signal

        multiprocessing.set_start_method("fork", force=True)
        # A spawned child starts with default signal handling; the server's launch-phase SIGQUIT
        # handler (set just before) is for the server alone.
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGQUIT, signal.SIG_DFL))
        _log("SGLang's scheduler and detokenizer are forked from the server")
        return result

    module._set_envs_and_config = then_fork


_POST_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
    "sglang.srt.models.deepseek_common.attention_backend_handler":
        _patch_latent_attention_handler,
    "sglang.srt.sampling.sampling_batch_info": _patch_sampling_batch_info,
    "sglang.srt.layers.sampler": _patch_sampler,
}
if os.environ.get("AGENT_RL_ENGINE_FORK", "1") != "0":
    _POST_IMPORT["sglang.srt.entrypoints.engine"] = _patch_engine_start_method
if os.environ.get("AGENT_RL_ENGINE_FAST_ATTENTION", "1") != "0":
    _POST_IMPORT["sglang.srt.layers.attention.torch_native_backend"] = _patch_torch_native_backend
_AROUND_IMPORT: dict[str, Callable[[types.ModuleType, Callable[[], None]], None]] = {
    "torchvision._meta_registrations": _around_torchvision_meta_registrations,
    "sglang.srt.models.registry": _around_model_registry,
}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, wrapped by an around-hook and followed by a post-hook."""

    def __init__(self, wrapped: Any, post: Any = None, around: Any = None) -> None:
        self._wrapped, self._post, self._around = wrapped, post, around

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        def run() -> None:
            self._wrapped.exec_module(module)

        if self._around is not None:
            self._around(module, run)
        else:
            run()
        if self._post is not None:
            try:
                self._post(module)
            except Exception as e:  # a failed patch must never break the import itself
                _warn(f"patch for {module.__name__} failed: {e!r}")

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._wrapped, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        post, around = _POST_IMPORT.get(fullname), _AROUND_IMPORT.get(fullname)
        if post is None and around is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, post=post, around=around)
        return spec


# --- 1. the sgl_kernel stand-in ------------------------------------------------------------------
class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"sgl_kernel.{name}() was called, but only agent-rl's import-only stand-in for "
                "the CPU build of sgl-kernel is installed"
            )

        missing.__name__ = name
        return missing


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__version__ = "0.0.0+agent-rl-cpu-standin"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        _log(f"serving the import-only stand-in for {module.__name__!r}")


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: reached only when no installed sgl_kernel matched."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "sgl_kernel":
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader())


if _ENABLED and not any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchingFinder())
    sys.meta_path.append(_StandInFinder())
    _log("import hooks installed")
