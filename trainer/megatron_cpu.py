"""CPU compatibility patches for megatron-core on torch without a GPU (gloo backend), and the
one naming difference between the two megatron-core releases the trainer runs on.

Releases: 0.16.1 on Python 3.11 (its last release there), 0.19.2 on 3.12+ (pyproject's markers).
Every patch below applies to both unchanged; `mtp_decoder_layer()` names the one module that
moved.

megatron-core is written for CUDA: it asks torch.cuda for devices, RNG state, streams and
synchronisation, and creates a few tensors with a literal `device="cuda"`. Without a GPU every
one of those raises (a CPU-only torch: "Torch not compiled with CUDA enabled"; PyPI's CUDA build:
no device found). `apply()` replaces exactly those calls with CPU equivalents. It is a no-op when CUDA is available, idempotent, and
touches no installed file. Each patch was shown necessary for a path the trainer uses (model
forward/backward, MoE alltoall with EP, TP with sequence parallelism, the pipeline schedules,
Megatron DDP and (distributed) optimizer, dist_checkpointing); see ../shared/notes/megatron-cpu for the lab runs.

Call `apply()` before building any megatron module (trainer.model does).

One more, applied at import: megatron's `jit_fuser` decorator is `torch.compile`, and decorating
with it imports torch's dynamo and inductor, ~3 s of CPU in every trainer process (0.16; 0.19's
inference-only MoE router imports them with its own `@torch.compile`), for fusions the CPU
paths never call (and which inductor would compile with a C++ compiler if they did).
`eager_fusions()` (installed by `import trainer`, before any megatron import) calls megatron's
own `disable_jit_fuser()` as soon as `megatron.core.jit` has run, when CUDA is absent: those
functions run as written, in eager torch, as later megatron releases do on non-CUDA devices.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

APPLIED: list[str] = []


def apply() -> list[str]:
    """Patch megatron-core/torch for CPU when CUDA is absent; return the names of the patches."""
    if torch.cuda.is_available() or APPLIED:
        return APPLIED
    _device_and_rng()
    _causal_mask()
    _moe()
    _cuda_literals()
    _tied_embeddings()
    _latent_attention()
    return APPLIED


def eager_fusions() -> None:
    """Disable megatron's torch.compile fusions on CPU as megatron.core.jit is imported (see the
    module's docstring); a no-op once it has been imported."""
    if "megatron.core.jit" not in sys.modules and not any(
        isinstance(f, _EagerFusionsFinder) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _EagerFusionsFinder())


class _EagerFusionsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def run_then_disable(module: types.ModuleType) -> None:
            run(module)
            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = run_then_disable  # type: ignore[method-assign]
        return spec


def mtp_decoder_layer() -> str:
    """The name of an MTP module's decoder layer in megatron's module tree and state dict:
    `transformer_layer` in megatron-core 0.16, `mtp_model_layer` in 0.19 (whose dist
    checkpoints map it back to `transformer_layer`). Read off the installed release."""
    import dataclasses

    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionLayerSubmodules as Submodules,
    )

    names = {f.name for f in dataclasses.fields(Submodules)}
    return "mtp_model_layer" if "mtp_model_layer" in names else "transformer_layer"


def _device_and_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    # Reason: GlobalMemoryBuffer, attention and MoE ask torch.cuda.current_device() for a device.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    APPLIED.append("current_device->cpu")

    # Reason: the model-parallel RNG tracker saves/restores CUDA RNG state; use the CPU generator.
    # (Not torch.manual_seed: it calls torch.cuda.manual_seed_all, i.e. would recurse.)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    APPLIED.append("cuda_rng->cpu_generator")

    # Reason: dist_checkpointing.save preloads tensors and calls torch.cuda.synchronize().
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    APPLIED.append("synchronize->noop")

    # Reason: the MoE alltoall dispatcher and DDP create CUDA streams/events; CPU ops are ordered.
    torch.cuda.Event = _NoEvent  # type: ignore[assignment,misc]
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    APPLIED.append("streams/events->no-ops")


def _causal_mask() -> None:
    import megatron.core.transformer.utils as tutils
    from megatron.core.fusions import fused_softmax

    # Reason: attention_mask=None (right-padded causal batches) builds the mask on device="cuda".
    @functools.lru_cache(maxsize=32)
    def causal(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = causal
    fused_softmax.get_default_causal_mask = causal
    APPLIED.append("default_causal_mask->cpu")


def _moe() -> None:
    import megatron.core.transformer.moe.token_dispatcher as dispatcher
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils

    # Reason: 0.16.x references te_general_gemm, defined only when TransformerEngine imports.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        APPLIED.append("moe_utils.te_general_gemm=None")

    # Reason: EP>1 alltoall turns split sizes into lists only for CUDA tensors; CPU ones reach
    # all_to_all_single(split_sizes=<Tensor>) and fail.
    def maybe_move_tensor_to_cpu(
        tensor: Any, as_numpy: bool = False, record_stream: bool = False
    ) -> Any:
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    APPLIED.append("moe split sizes->numpy on cpu")

    # Reason: MoE with TP>1 requires sequence parallelism, but the local-spec torch norm asserts
    # it off (only TE norms support it). The norm is elementwise, so build it and tag its params
    # sequence_parallel so finalize_model_grads all-reduces their grads over the TP group.
    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *a: Any, **k: Any) -> Any:
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *a, **k)
        object.__setattr__(config, "sequence_parallel", False)
        try:
            norm = original_new(cls, config, hidden_size, eps, *a, **k)
        finally:
            object.__setattr__(config, "sequence_parallel", True)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)  # type: ignore[assignment]
    APPLIED.append("torch norm with sequence_parallel")


# megatron modules that create tensors with a literal device="cuda" on paths the trainer uses
# (optimizer step, grad clipping and norms, DDP grad buffers, the forward/backward schedules'
# token counter).
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)
_FACTORIES = frozenset(
    {
        "tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "as_tensor",
    }
)


class _TorchOnCpu:
    """`torch` as seen by the modules above: factories send device="cuda" to the CPU."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        return _cpu_factory(attr) if name in _FACTORIES else attr


def _cuda_literals() -> None:
    import importlib

    # Reason: the optimizer, grad clipping, grad buffers and schedules write device="cuda".
    # Scoped to those modules: patching torch's factories globally breaks transformers' loading.
    proxy = _TorchOnCpu()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy  # type: ignore[attr-defined]
    APPLIED.append("device='cuda' literals->cpu in megatron optimizer/ddp/ckpt modules")

    # Reason: the (distributed) optimizer and grad clipping accept only params whose
    # .type() is 'torch.cuda.FloatTensor' (or Half/BFloat16). Answer so only to megatron callers.
    original_type = torch.Tensor.type

    def type_(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        result = original_type(self, *a, **k)
        if a or k or not isinstance(result, str) or result.startswith("torch.cuda."):
            return result
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("megatron.") and result.startswith("torch."):
            return "torch.cuda." + result[len("torch.") :]
        return result

    torch.Tensor.type = type_  # type: ignore[assignment]
    APPLIED.append("Tensor.type()->torch.cuda.* for megatron")


def _latent_attention() -> None:
    import megatron.core.transformer.multi_latent_attention as mla

    # Reason: without TransformerEngine its megatron extension still imports, its classes mock
    # stand-ins, so MLA's `isinstance(self.linear_proj, TELinear)` raises. Classes nothing is
    # an instance of keep those checks false, as they are without TE.
    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name), type):
            setattr(mla, name, type(f"No{name}", (), {}))
    # megatron-core 0.19 (Python 3.12's) imports the plain `Linear` that MLA accepts for its
    # down projections only with TransformerEngine (None without): the one the deepseek_v3
    # family's spec names (agent_rl/families/deepseek_v3.py).
    from megatron.core.post_training.modelopt.layers import Linear

    mla.Linear = Linear
    APPLIED.append("MLA's TransformerEngine checks without TransformerEngine")


def _tied_embeddings() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    # Reason: with pipeline parallelism and tied embeddings, the last stage's copy of the
    # embedding is moved with `weight.data.cuda()` before the all-reduce that fills it from the
    # first stage's. Keep it where it is for that call only.
    original = LanguageModule.setup_embeddings_and_output_layer

    def setup(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor  # type: ignore[assignment]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup  # type: ignore[method-assign]
    APPLIED.append("tied embeddings under PP stay on cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare CUDA ordinal


def _cpu_factory(factory: Any) -> Any:
    @functools.wraps(factory)
    def wrapper(*a: Any, **k: Any) -> Any:
        if _is_cuda(k.get("device")):
            k["device"] = "cpu"
        return factory(*a, **k)

    return wrapper


class _NoEvent:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, *a: Any, **k: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *a: Any, **k: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, *a: Any, **k: Any) -> None:
        pass

    def wait_event(self, *a: Any, **k: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a: Any, **k: Any) -> _NoEvent:
        return _NoEvent()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


_STREAM = _NoStream()
