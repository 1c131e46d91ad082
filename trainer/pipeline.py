"""Micro-batches through megatron-core's forward/backward schedules; results off the last stage.

With `pp` > 1 each rank holds one pipeline stage (a slice of the decoder layers, the embedding
on the first stage, the final norm and output layer on the last). `run` hands a step's
micro-batches to megatron's schedule (`megatron.core.pipeline_parallel.get_forward_backward_func`):
for pp > 1 the non-interleaved 1F1B schedule, which sends each micro-batch's activations to the
next stage and their gradients back, and keeps at most pp micro-batches in flight; the stages
exchange each activation's shape first (`variable_seq_lengths`, see trainer.model), since packed
rows and a step's last padded micro-batch differ. For pp = 1 the same call is megatron's
no-pipelining schedule: forward then backward, micro-batch by micro-batch.

Only the last stage has logits. There `on_output(index, micro, output)` turns a micro-batch's
output into the loss to backpropagate (or into logprobs it keeps, for a forward-only run), and
`from_last_stage` hands what the last stage computed (logprobs, a step's metrics) to every
rank of its pipeline group: the loop's rank 0, on the first stage, reports them.

Losses are divided by global denominators before they get here (trainer.learner), so megatron
is told not to scale them (`calculate_per_token_loss`): its token count is unused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from trainer.packing import MicroBatch

T = TypeVar("T")


def is_last_stage() -> bool:
    """Whether this rank holds the last pipeline stage (the logits)."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def run(
    model: torch.nn.Module,
    micros: Sequence[MicroBatch],
    forward: Callable[[MicroBatch], Any],
    on_output: Callable[[int, MicroBatch, Any], torch.Tensor | None],
    *,
    forward_only: bool,
) -> None:
    """Every micro-batch through this rank's stage, forwards and (unless `forward_only`)
    backwards in the schedule's order. `forward(micro)` runs `model` on a micro-batch (on a
    later stage the model takes its input from the previous stage, not the tokens); on the last
    stage `on_output` gets its output and returns the loss to backpropagate (None: nothing)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data: Any, _model: Any) -> tuple[Any, Callable[[Any], Any]]:
        index, micro = next(data)
        output = forward(micro)

        def loss_func(out: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            loss = on_output(index, micro, out)
            return (torch.zeros(()) if loss is None else loss), torch.tensor(0, dtype=torch.int), {}

        return output, loss_func

    first = micros[0].batch.tokens if micros[0].packed is None else micros[0].packed.tokens
    rows, length = first.shape
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(enumerate(micros)),
        model=model,
        num_microbatches=len(micros),
        # Only a default: stages exchange each micro-batch's shape (variable_seq_lengths).
        seq_length=length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def from_last_stage(value: T) -> T:
    """The last pipeline stage's `value` on every rank of this rank's pipeline group (the
    others pass anything, e.g. None); with pp = 1, `value` itself."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(
        box,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return box[0]
