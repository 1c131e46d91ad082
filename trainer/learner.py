"""The learner: a Megatron GPTModel + Megatron optimizer that takes RL and SFT steps.

`Learner(model_dir, cfg)` initialises torch.distributed and megatron's parallel groups (a world
of one, or whatever torchrun set up), builds the model from the HF directory, wraps it in
Megatron's DistributedDataParallel and builds Megatron's (distributed) Adam optimizer.
("Engine" in this project is the SGLang server; the learner is what trains.)

Data contract: every rank calls every method collectively. Ranks in one tensor-parallel or
pipeline-parallel group (and the EP ranks that share a data-parallel index) must pass identical
batches; different data-parallel ranks pass their own shards. Losses are normalised by
denominators all-reduced over the data-parallel group (tokens for "token-mean", sequences
otherwise), and Megatron is told not to average again (`calculate_per_token_loss`), so any
DP/micro-batch split of a batch gives the same gradient. Micro-batches run through megatron's
forward/backward schedule (trainer.pipeline: 1F1B over the pipeline stages when pp > 1), and
the losses and logprobs, computed on the last stage, are returned on every rank. Returned
metrics are global (reduced over data-parallel ranks).

One optimizer step per batch: the PPO ratio is taken against the trainer's own logprobs at the
start of the step (so it is 1 and `clip_fraction` 0; clipping matters for losses shared with
multi-step callers), and TIS weights each token by min(pi_train / pi_rollout, cap), which is
what corrects for stale or mismatched rollout logprobs. Checkpoints are dist_checkpointing
directories (model + optimizer + step, trainer.checkpoint: a script that saves must guard its
entry point with `if __name__ == "__main__"`); exports are HF safetensors directories that
SGLang and transformers load.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent_rl.config import TrainerConfig
from trainer import checkpoint, dist_env, hf_convert, mtp, packing, pipeline, shard
from trainer.arch import ModelArch, Parallel, check_parallel, draft_heads
from trainer.batch import Batch
from trainer.logprobs import token_entropy, token_logprobs
from trainer.advantages import get_estimator
from trainer.loss import get_policy_loss, policy_loss, sft_loss
from trainer.model import build_gpt_model
from trainer.packing import MicroBatch, per_token_rope
from trainer.routing_replay import Mismatch


class Learner:
    """Policy model + optimizer on this rank; see the module docstring for the data contract."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, lr: float | None = None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import (
            OptimizerConfig,
            ParamKey,
            get_megatron_optimizer,
            get_standard_config_overrides,
        )

        # A misspelt loss or estimator fails before anything is built.
        get_policy_loss(cfg.loss.policy_loss)
        get_estimator(cfg.loss.advantage)
        torch.set_num_threads(cfg.threads)
        self.cfg, self.model_dir = cfg, Path(model_dir)
        self.par = Parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
        self.arch = ModelArch.from_hf_dir(self.model_dir)
        # Before any process group forms.
        check_parallel(self.arch, self.par, cfg.mtp.layers, cfg.mtp.ffn_hidden_size,
                       cfg.mtp.num_attention_heads)
        dist_env.init(self.par, cfg.seed)
        bf16 = cfg.dtype == "bf16"
        module = build_gpt_model(
            self.arch,
            self.par,
            torch.bfloat16 if bf16 else torch.float32,
            mtp_layers=cfg.mtp.layers,
            mtp_detach=cfg.mtp.detach,
            mtp_ffn_hidden_size=cfg.mtp.ffn_hidden_size,
            mtp_attention_heads=draft_heads(self.arch, cfg.mtp.num_attention_heads),
            # The load fills every weight, except an MTP draft the files may not carry. Under
            # tensor parallelism megatron's CPU initialisation is also what marks a weight as
            # split (`tensor_model_parallel`, `partition_dim`), which the load's sharding reads.
            initialize=bool(cfg.mtp.layers) or self.par.tp > 1,
        )
        # Our losses are already divided by global (DP-reduced) denominators: no DP averaging.
        module.config.calculate_per_token_loss = True
        load_hf_weights(module, self.arch, self.model_dir, cfg.mtp.layers)
        if cfg.mtp.layers and not cfg.mtp.train:
            # A frozen draft: out of the DDP buffers and the optimizer, so no step moves it.
            for param in module.mtp.parameters():
                param.requires_grad_(False)
        self._gpt = module
        if bf16:
            from megatron.core.transformer.module import Float16Module

            # bf16 parameters and activations; logits come out in fp32 (losses and logprobs
            # are computed there), the optimizer keeps fp32 master weights and state.
            module = Float16Module(module.config, module)
        self.lr = lr if lr is not None else cfg.optim.lr
        self.model = DistributedDataParallel(
            module.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            ),
            module,
        )
        optimizer = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            adam_beta1=cfg.optim.beta1,
            adam_beta2=cfg.optim.beta2,
            adam_eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
            clip_grad=cfg.optim.grad_clip,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        # Megatron's parameter groups: no weight decay on biases and 1-d weights (norms), and
        # the draft at its own learning rate (RL steps; SFT passes `lr` and trains all at it).
        groups = get_standard_config_overrides(optimizer)
        if cfg.mtp.lr is not None and lr is None and cfg.mtp.layers and cfg.mtp.train:
            groups[ParamKey(name="*mtp.*")] = {"max_lr": cfg.mtp.lr}
        self.optimizer = get_megatron_optimizer(optimizer, [self.model], config_overrides=groups)
        self.routing_replay = None
        if self.arch.is_moe:
            from trainer.routing_replay import RoutingReplay

            self.routing_replay = RoutingReplay(
                sequence_parallel=module.config.sequence_parallel,
                first_layer=max(shard.layer_offset(module) - self.arch.dense_layers, 0),
                num_layers=self.arch.num_moe_layers,
                dense_layers=self.arch.dense_layers,
            )
        # The KL reference is the starting policy; kept as a copy of this rank's shard.
        self._ref = ([p.detach().clone() for p in self._gpt.parameters()]
                     if cfg.loss.kl_coef else None)
        self.step = 0

    # ----- forward ---------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (this rank's shard), under any precision wrapper."""
        return self._gpt

    def _prepare(self, batch: Batch) -> Batch:
        tp = self.par.tp
        if self.module.config.sequence_parallel and batch.length % tp:
            return batch.pad_to(batch.length + tp - batch.length % tp)
        return batch

    def _forward(self, micro: MicroBatch, seen: list[Mismatch] | None = None) -> Any:
        """This stage's output for a micro-batch: on the last stage logits [b, T, V/tp] (a packed
        micro-batch's [1, P, V/tp]), or with `mtp_layers` (logits, [each depth's draft logits]);
        on an earlier one the hidden states for the next stage. A MoE batch that carries routed
        experts is routed by them (`routing_replay`), and its routing mismatch goes to `seen`."""
        pk, mb = micro.packed, micro.batch
        if pk is None:
            tokens, experts, mask = mb.tokens, mb.routed_experts, None
            positions = torch.arange(mb.length).unsqueeze(0).expand(mb.size, -1)
        else:
            tokens, experts, mask, positions = pk.tokens, pk.routed_experts, pk.attention_mask, pk.positions

        def run() -> Any:
            with contextlib.nullcontext() if pk is None else per_token_rope(self.module, positions):
                return self.model(tokens, positions, mask)

        if self.routing_replay is None or experts is None:
            return run()
        with self.routing_replay.forward_context(experts, self.cfg.routing_replay) as mismatch:
            out = run()
        if seen is not None:
            seen.append(mismatch)
        return out

    def _scores(self, micro: MicroBatch, logits: torch.Tensor, entropy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [b, T-1] of the micro-batch's tokens (position t scores token t+1), in the
        padded layout whatever the micro-batch's, and the entropy there if asked."""
        pk = micro.packed
        tokens = micro.batch.tokens if pk is None else pk.tokens
        lp = token_logprobs(logits, tokens)
        ent = token_entropy(logits) if entropy else None
        if pk is not None:
            lp = pk.unpack(lp)
            ent = pk.unpack(ent) if ent is not None else None
        return lp, ent

    @torch.no_grad()
    def logprobs(self, batch: Batch, entropy: bool = False) -> dict[str, torch.Tensor]:
        """Token-aligned logprobs [B, T] (column 0 is 0: token 0 has no prediction) and, if asked,
        the entropy of the distribution each token was drawn from; no gradient, no update."""
        T = batch.length
        batch = self._prepare(batch)
        out: dict[str, torch.Tensor] = {"logprobs": torch.zeros(batch.size, batch.length)}
        if entropy:
            out["entropy"] = torch.zeros(batch.size, batch.length)

        def keep(_: int, micro: MicroBatch, output: Any) -> None:
            lp, ent = self._scores(micro, _logits(output), entropy)
            out["logprobs"][micro.rows, 1:] = lp
            if ent is not None:
                out["entropy"][micro.rows, 1:] = ent

        with self._drafts_off():
            pipeline.run(
                self.model, self._micro_batches(batch), self._forward, keep, forward_only=True
            )
        out = pipeline.from_last_stage(out)  # computed on the last stage, returned on every rank
        return {key: value[:, :T] for key, value in out.items()}

    @contextlib.contextmanager
    def _drafts_off(self) -> Iterator[None]:
        """Forwards inside skip the MTP modules (their drafts would go unused)."""
        module = self.module
        if not getattr(module, "run_drafts", False):
            yield
            return
        module.run_drafts = False
        try:
            yield
        finally:
            module.run_drafts = True

    # ----- steps -----------------------------------------------------------------------------

    def rl_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the configured policy loss on `batch`; returns global metrics."""
        return self._step(batch, sft=False)

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of cross-entropy on the loss-mask tokens of `batch`."""
        return self._step(batch, sft=True)

    def _step(self, batch: Batch, sft: bool) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        batch = self._prepare(batch)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        mask = batch.loss_mask[:, 1:]
        counts = torch.tensor([float(mask.sum()), float(batch.size)], dtype=torch.float64)
        self._dp_sum(counts)
        denominator = float(counts[0] if self.cfg.loss.aggregation == "token-mean" else counts[1])
        # Tokens each MTP depth is scored on, over the whole batch (all DP ranks).
        depths = range(1, self.cfg.mtp.layers + 1)
        mtp_counts = torch.tensor([float(mtp.shifted_mask(mask, j).sum()) for j in depths],
                                  dtype=torch.float64)  # fmt: skip
        if self.cfg.mtp.layers:
            self._dp_sum(mtp_counts)
        sums: dict[str, float] = {}
        micros = self._micro_batches(batch)  # planned once: the reference pass runs the same
        # Reference logprobs first: swapping weights after a forward would break its backward.
        refs = self._reference_logprobs(micros) if self._ref is not None and not sft else None

        def loss_of(index: int, micro: MicroBatch, output: Any) -> torch.Tensor:
            """The last stage's loss of one micro-batch (its metrics added to `sums`)."""
            mb = micro.batch
            logits, drafts = output if isinstance(output, tuple) else (output, [])
            lp, entropy = self._scores(micro, logits, entropy=True)
            assert entropy is not None
            mb_mask = mb.loss_mask[:, 1:]
            if sft:
                out = sft_loss(lp, mb_mask, self.cfg.loss.aggregation, denominator)
            else:
                out = policy_loss(
                    lp,
                    lp.detach(),
                    mb.advantages,
                    mb_mask,
                    self.cfg.loss,
                    rollout_logprobs=mb.rollout_logprobs[:, 1:],
                    ref_logprobs=refs[index] if refs is not None else None,
                    denominator=denominator,
                )
            loss = out.loss
            if drafts:
                # SFT steps train the draft on the demonstrations' tokens: from a fresh draft
                # that learns faster than following the policy's distribution (docs/trainer.md).
                objective = "nll" if sft else self.cfg.mtp.objective
                draft_loss, draft_metrics = self._mtp_terms(
                    micro, logits, drafts, mtp_counts, objective
                )
                if self.cfg.mtp.train:
                    loss = loss + self.cfg.mtp.loss_coef * draft_loss
                for key, value in draft_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
            out.metrics["entropy"] = float((entropy * mb_mask).sum() / max(out.tokens, 1))
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + value * out.tokens
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            return loss

        seen: list[Mismatch] = []
        pipeline.run(
            self.model, micros, lambda micro: self._forward(micro, seen), loss_of,
            forward_only=False,
        )
        sums.update(self._routing_counts(seen))
        finalize_model_grads([self.model])
        self._set_lr()
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        # The losses are the last stage's; every rank returns its metrics.
        last = pipeline.is_last_stage()
        return pipeline.from_last_stage(
            self._global_metrics(sums, counts, grad_norm, ok) if last else None
        )

    def _routing_counts(self, seen: list[Mismatch]) -> dict[str, float]:
        """Tokens of the step whose free routing differs from the replayed experts in some MoE
        layer (of any pipeline stage), and tokens with recorded routing; {} without either."""
        if not seen:
            return {}
        tokens = sum(m.tokens for m in seen)
        if self.par.pp == 1:
            differing = sum(m.differing_tokens for m in seen)
        else:
            assert self.routing_replay is not None
            differing = self.routing_replay.differing_on_any_stage(seen)
        return {"routing_mismatch_tokens": float(differing), "routing_tokens": float(tokens)}

    def _mtp_terms(
        self, micro: MicroBatch, logits: torch.Tensor, drafts: list[torch.Tensor],
        counts: torch.Tensor, objective: str,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The drafts' loss and metrics on this micro-batch, each depth scored at its anchors
        (the positions whose target is a policy token) alone:
        - the loss: each depth's `objective` (`mtp.draft_terms`) summed over its anchors, over its
          global token count (`counts`), averaged over depths; each depth's share of its global
          mean nll (`mtp_nll_{j}`, whatever the objective) and of the average loss (`mtp_loss`),
          to be summed over micro-batches;
        - at the weights the step starts from, each depth's share of its expected acceptance
          (`mtp_acceptance_{j}`) and of the expected accepted length of all k drafts
          (`mtp_accept_length`, over the anchors whose next token but one is a policy token).
        `drafts` are the depths' hidden states; `logits` the policy's."""
        pk, mb = micro.packed, micro.batch
        mask = mb.loss_mask[:, 1:]
        total = torch.zeros(())
        alphas, masks, metrics = [], [], {}
        for depth, hidden in enumerate(drafts, start=1):
            targets = mtp.shifted_mask(mask, depth)
            rows, cols = targets.nonzero(as_tuple=True)
            # The logits' positions of the anchors: the same, or the packed row's.
            at = (rows, cols) if pk is None else (torch.zeros_like(rows), pk.index[rows, cols])
            draft = self.module.draft_logits(hidden, *at)
            policy = logits[at[0], at[1] + depth]  # the policy's logits of the same tokens
            sampled = mb.tokens[rows, cols + 1 + depth]
            denominator = max(float(counts[depth - 1]), 1.0)
            loss, nll, accepted = mtp.draft_terms(draft, policy, sampled, objective)
            total = total + loss.sum() / denominator
            metrics[f"mtp_nll_{depth}"] = float(nll.sum()) / denominator
            alpha = torch.zeros_like(mask)
            alpha[rows, cols] = accepted
            metrics[f"mtp_acceptance_{depth}"] = float(accepted.sum()) / denominator
            alphas.append(alpha)
            masks.append(targets)
        metrics["mtp_loss"] = float(total.detach()) / len(drafts)
        length = mtp.accepted_length(alphas, masks)
        metrics["mtp_accept_length"] = float((length * masks[0]).sum()) / max(float(counts[0]), 1.0)
        return total / len(drafts), metrics

    def _micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """`micro_batch_size` padded rows each, or with `max_tokens_per_micro_batch` one packed
        row each (trainer.packing)."""
        budget = self.cfg.max_tokens_per_micro_batch
        if budget is None:
            return packing.padded(batch, self.cfg.micro_batch_size)
        multiple = self.par.tp if self.module.config.sequence_parallel else 1
        return packing.packed(batch, budget, multiple)

    def _set_lr(self) -> None:
        """Each parameter group's learning rate (its `max_lr`: the policy's, or the draft's
        `mtp_lr`) after the warm-up ramp, and its weight decay (`wd_mult`: 0 for biases and
        norms), as megatron's OptimizerParamScheduler would set them."""
        warm = self.cfg.optim.lr_warmup_steps
        ramp = min(1.0, (self.step + 1) / warm) if warm else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = group["max_lr"] * ramp
            group["weight_decay"] = self.cfg.optim.weight_decay * group["wd_mult"]

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(t, group=ps.get_data_parallel_group())
        return t

    def _global_metrics(
        self, sums: dict[str, float], counts: torch.Tensor, grad_norm: Any, ok: bool
    ) -> dict[str, float]:
        keys = sorted(sums)
        totals = self._dp_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        metrics: dict[str, float] = {}
        for key, total in zip(keys, totals.tolist()):
            if key in ("loss", "routing_mismatch_tokens", "routing_tokens") or key.startswith(
                "mtp_"
            ):
                metrics[key] = total
            else:
                metrics[key] = total / max(float(counts[0]), 1.0)
        if "routing_tokens" in metrics:
            metrics["routing_mismatch_fraction"] = metrics.pop("routing_mismatch_tokens") / max(
                metrics.pop("routing_tokens"), 1.0
            )
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
            update_ok=float(ok),
            tokens=float(counts[0]),
            step=float(self.step),
        )
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, micros: list[MicroBatch]) -> list[torch.Tensor]:
        """Per micro-batch logprobs [b, T-1] of the step's `micros` under the starting weights
        (swapped in, then back); on the last pipeline stage (the only one that uses them)."""
        params = list(self.module.parameters())
        current = [p.detach().clone() for p in params]
        refs: list[torch.Tensor] = []

        def keep(_: int, micro: MicroBatch, output: Any) -> None:
            refs.append(self._scores(micro, _logits(output))[0])

        try:
            for p, ref in zip(params, self._ref or []):
                p.copy_(ref)
            with self._drafts_off():
                pipeline.run(self.model, micros, self._forward, keep, forward_only=True)
            return refs
        finally:
            for p, cur in zip(params, current):
                p.copy_(cur)

    # ----- persistence -----------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path, keep: int | None = None) -> Path:
        """Write model + optimizer + step into `directory/step_N` (trainer.checkpoint); with
        `keep`, older checkpoints than the newest `keep` are deleted."""
        return checkpoint.save(self.module, self.optimizer, self.step, directory, keep)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore model, optimizer and step from a `save_checkpoint` directory; return the step."""
        self.step = checkpoint.load(self.module, self.optimizer, path)
        return self.step

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in HF names and layouts (gathered over TP/PP/EP: every rank calls it),
        as engines load them; on ranks other than 0, {}. Valid until the next step: where no
        gather or layout change is needed the tensors are the parameters themselves, not copies
        (an in-memory push copies each into its bucket; a copy first cost a 105M model 0.04 s
        warm, more where its 420 MB had to be paged in anew)."""
        full = shard.gather_full_state_dict(self.module, self.arch, copy=False)
        return hf_convert.mcore_to_hf(full, self.arch) if dist.get_rank() == 0 else {}

    def export_hf(self, directory: str | Path) -> Path:
        """Write an HF safetensors model directory (config and tokenizer copied from the start)."""
        # Not copied here: write_hf_dir copies each tensor before it writes.
        full = shard.gather_full_state_dict(self.module, self.arch, copy=False)
        out = Path(directory)
        if dist.get_rank() == 0:
            hf_convert.write_hf_dir(hf_convert.mcore_to_hf(full, self.arch), out, self.model_dir)
        dist.barrier()
        return out

    def release(self) -> None:
        """Let the model, its optimizer and the process groups they hold be freed once this
        learner is dropped. Megatron's DDP keeps its gradient hooks' autograd nodes in
        `grad_accs`, and a module may keep a tensor of its last forward (the MoE token
        dispatcher's `probs`) whose graph reaches those nodes; the nodes hold the hooks, whose
        closures hold the DDP: cycles through C++ objects that Python's gc cannot see. Kept,
        they pin every model built in the process and its process groups, each gloo group with
        its own threads (a test session had 1,700 of them polling)."""
        for module in self.model.modules():
            # The module's own attributes and those of the plain objects it keeps (the
            # dispatcher is not a Module).
            helpers = [v for v in vars(module).values()
                       if hasattr(v, "__dict__")
                       and not isinstance(v, (torch.nn.Module, type, types.ModuleType))]
            for holder in (module, *helpers):
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)
        self.model.grad_accs.clear()


def _logits(output: Any) -> torch.Tensor:
    """The policy's logits of a last-stage output (without the MTP drafts' beside them)."""
    return output[0] if isinstance(output, tuple) else output


def load_hf_weights(
    model: torch.nn.Module, arch: ModelArch, path: str | Path, mtp_layers: int = 0
) -> None:
    """Copy the HF safetensors in `path` into this rank's shard of `model` (exactly, no casts
    beyond the model dtype); raise ConfigError if the files do not match the config. MTP
    modules load from the files' `mtp.*` weights, or keep their initialisation without any."""
    # Streamed: each tensor is read from its file as the conversion asks for it and goes into
    # the parameters as it comes out, so a load holds one layer's weights beside the model.
    sink = shard.ParamSink(model, arch, keep="mtp." if mtp_layers else None, adopt=True)
    hf_convert.hf_to_mcore(hf_convert.lazy_safetensors(path), arch, mtp_layers, out=sink)
    sink.finish()


@contextlib.contextmanager
def learner(model_dir: str | Path, cfg: TrainerConfig, lr: float | None = None) -> Iterator[Learner]:
    """A Learner whose process groups are torn down on exit (tests, one-shot tools), and when
    it cannot be made (e.g. weights that do not fit the config)."""
    try:
        made = Learner(model_dir, cfg, lr)
    except BaseException:
        dist_env.teardown()
        raise
    try:
        yield made
    finally:
        made.release()
        dist_env.teardown()
