"""Config of the Megatron-core trainer (`agent-rl train`): `[trainer]` and its sections.

`[trainer]` holds what every step uses (model, batch, staleness, checkpoints, exports); each
concern with knobs of its own is a table under it: `[trainer.optim]`, `[trainer.loss]`,
`[trainer.parallel]`, `[trainer.mtp]`, `[trainer.eval]`, `[trainer.sft]`,
`[trainer.weight_sync]`. The flat keys of earlier versions (`trainer.adam_beta1`, ...) are
refused with the key to write instead (agent_rl/config/moved.py).

The policy loss and the advantage estimator are names looked up in the trainer's registries
(trainer/loss.py, trainer/advantages.py) when the learner starts: config is the bottom layer
and cannot import them, and a new loss then needs no edit here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from agent_rl.config.base import Section
from agent_rl.config.moved import TRAINER_MOVED, moved_keys


class OptimConfig(Section):
    """`[trainer.optim]`: Adam(W) of RL steps."""

    lr: float = Field(default=3e-5, gt=0)
    """Adam learning rate for RL (3e-5 suits the tiny models; 1e-3 or 3e-4 collapsed them)."""

    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps over which the learning rate ramps linearly up to `lr`."""

    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""

    beta2: float = Field(default=0.99, ge=0, lt=1)
    """Adam beta2."""

    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (AdamW style)."""

    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""


class LossConfig(Section):
    """`[trainer.loss]`: the RL objective, chosen in two independent parts."""

    policy_loss: str = "grpo"
    """How a sequence's advantage becomes per-token loss: a name in trainer/loss.py's
    `POLICY_LOSSES` (grpo: token-level PPO-clip; the others in docs/trainer.md)."""

    advantage: str = "grpo"
    """How rewards become per-episode advantages: a name in trainer/advantages.py's `ESTIMATORS`
    (grpo: group mean and std; the others in docs/trainer.md)."""

    clip_eps_low: float = Field(default=0.2, ge=0)
    """Lower clip range: ratios below 1 - clip_eps_low stop pushing (GSPO: ~3e-4)."""

    clip_eps_high: float = Field(default=0.28, ge=0)
    """Upper clip range: ratios above 1 + clip_eps_high stop pushing (GSPO: ~4e-4)."""

    tis_cap: float | None = Field(default=2.0, gt=0)
    """Truncated importance sampling: weight tokens by min(pi_train / pi_rollout, cap) to
    correct train/inference mismatch and staleness; unset disables it."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (starting) policy; 0 skips the reference."""

    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses become the step's loss."""

    @field_validator("policy_loss")
    @classmethod
    def _no_ppo(cls, value: str) -> str:
        if value == "ppo":
            # "ppo" took the same group-normalised advantages as "grpo": it was "grpo".
            raise PydanticCustomError(
                "removed_value", '"ppo" was removed (it was "grpo" on the same advantages, with '
                'no critic): write trainer.loss.policy_loss = "grpo" and choose the advantages '
                "with trainer.loss.advantage")
        return value


class ParallelConfig(Section):
    """`[trainer.parallel]`: how the model and optimizer are split over ranks."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size."""

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size: each of pp stages holds num_layers / pp decoder layers and
    megatron's 1F1B schedule runs the micro-batches through them (not with `mtp.layers`)."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE models)."""

    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""


class MtpConfig(Section):
    """`[trainer.mtp]`: the multi-token-prediction draft trained beside the policy."""

    layers: int = Field(default=0, ge=0)
    """Multi-token prediction draft modules (megatron-core MTP) trained with the policy and
    exported as the draft SGLang serves for the model (it serves the first): a Qwen3-MoE's
    `Qwen3MoeForCausalLMMTP` (`mtp.*` weights), a dense Qwen2/Qwen3's EAGLE draft
    (`Qwen2ForCausalLMEagle`, the export's `draft/`); 0: none."""

    ffn_hidden_size: int | None = Field(default=None, ge=1)
    """Width of the MTP draft layer's MLP (a dense model's EAGLE draft, whose `draft/config.json`
    carries it as `intermediate_size`); None: the model's. A narrower draft costs the learner
    and the engine less per token: the draft is one decoder layer, so beside a shallow model it
    is a large share of a step (bench/mtp.py). A Qwen3-MoE's MTP draft is the model's own layer
    (SGLang builds it from the target's config): refused there."""

    num_attention_heads: int | None = Field(default=None, ge=1)
    """Query heads of the MTP draft layer's attention (a dense model's EAGLE draft), each the
    model's head_dim wide, with as many key/value heads as the model has or as the draft has
    query heads where those are fewer (they must divide them); `draft/config.json` carries them
    (`num_attention_heads`, `num_key_value_heads`, `head_dim`). None: the model's. Fewer heads
    cut the attention's share of the draft's cost, which grows with the context; on the
    quickstart's short episodes one head saved 0.01-0.03 of a step and followed the policy less
    closely (bench/mtp.py). Refused for a Qwen3-MoE, as `ffn_hidden_size` is."""

    loss_coef: float = Field(default=1.0, ge=0)
    """Weight of the MTP loss (each depth's `objective` over the policy's own sampled tokens,
    averaged over depths) added to each step's loss."""

    objective: Literal["nll", "kl", "tv"] = "nll"
    """The MTP loss of RL steps, per policy token each depth's draft predicts: `nll`, the
    cross-entropy of the sampled token (slime's MTP loss); `kl`, the forward KL divergence from
    the policy's whole distribution there (the nll's expectation over samples, without their
    noise); `tv`, the total variation distance to it, which is one minus the expected acceptance
    under speculative sampling, the quantity measured (DistillSpec's choice; bench/mtp.py).
    SFT steps train the draft with `nll` on the demonstrations' tokens."""

    lr: float | None = Field(default=None, gt=0)
    """Learning rate of the MTP modules in RL steps (Adam, with `optim.lr_warmup_steps`); None:
    the policy's `optim.lr`. The draft's loss is its own (detached, it never steers the policy),
    so it can learn at an SFT-like rate while the policy keeps RL's small one: at RL's rate a
    draft barely moves in a run and does not follow the policy (bench/mtp.py). SFT steps train
    the draft at `sft.lr`, with the policy."""

    detach: bool = True
    """Train the MTP modules on detached trunk hidden states, embeddings and output weight, so
    the draft follows the policy and never steers it; false: the MTP loss also trains the trunk."""

    train: bool = True
    """Update the MTP modules; false: a frozen draft (its weights stay those loaded from the
    model directory, e.g. an SFT export's `mtp.*`), whose loss and acceptance are still reported
    but whose loss is not added to the step's: the policy trains as without MTP."""


class EvalConfig(Section):
    """`[trainer.eval]`: evaluations of exported policy versions while training goes on."""

    every: int = Field(default=0, ge=0)
    """Evaluate every k policy versions (`agent-rl eval` of that version's export, in a process
    of its own, while rollout and training go on); 0: never."""

    tasks: int = Field(default=64, ge=1)
    """Tasks of each evaluation (the split's first ones)."""

    samples: int = Field(default=4, ge=1)
    """Episodes per task of each evaluation."""

    env: str | None = None
    """Environment of the evaluations; unset: `rollout.env`."""

    split: str = "eval"
    """Task split of the evaluations."""

    seed: int = 1234
    """Seed of the evaluations (task order and every request's sampling seed)."""

    nice: int = Field(default=10, ge=0, le=19)
    """CPU niceness of each evaluation (its process and the engine it starts): on a host that
    also runs rollout and training, evaluations take the spare CPU, not theirs."""

    cpu_idle: bool = True
    """Run each evaluation (its process and the engine it starts) under Linux's SCHED_IDLE: it
    gets a core only when rollout and training leave it idle (niceness alone still gives it a
    weighted share of a busy core). On a saturated host an evaluation then waits for spare CPU.
    Elsewhere than Linux, `nice` alone. Either way the evaluator's session (Linux schedules each
    session as a group, agent_rl/kernel/priority.py) gets the same lower priority."""

    router_url: str | None = None
    """Engines the evaluations load their weights on (a fleet of their own: the training fleet
    keeps serving the newest policy); unset: each starts an engine of its own."""


class SftConfig(Section):
    """`[trainer.sft]`: `agent-rl train --sft` (cross-entropy on demonstration tokens)."""

    lr: float = Field(default=1e-3, gt=0)
    """Learning rate of an SFT run."""

    steps: int = Field(default=1000, ge=1)
    """Optimizer steps of an SFT run."""

    batch_size: int = Field(default=16, ge=1)
    """Demonstration transcripts per SFT optimizer step."""

    demos: int = Field(default=4096, ge=1)
    """Distinct demonstrations an SFT run draws (then cycles through): enough that a small model
    learns the skill rather than memorising the transcripts."""


class WeightSyncConfig(Section):
    """`[trainer.weight_sync]`: how new weights reach the engines after a step."""

    mode: Literal["disk", "distributed", "tensor"] = "disk"
    """disk (every engine loads the step's HF export), distributed (a broadcast over a process
    group of this trainer and every engine: gloo on CPU, NCCL on GPU), tensor (tensors in shared
    memory: engines on this host only). In-memory modes sync after every step; exports are
    still written every `trainer.export_every`."""

    router_url: str | None = None
    """Router (or single SGLang server) the weights are synced through; unset:
    `rollout.router_url`; neither: weights are exported but not synced."""

    bucket_mb: float | None = Field(default=None, gt=0)
    """distributed / tensor: weights travel in buckets of at most this many MB (one broadcast
    or one update call each; a larger tensor travels alone). Unset: 64 for a gloo broadcast
    (CPU), 256 otherwise; measured on a 105M model's CPU push, 64 MB broadcasts took 0.52 s
    against 0.68 at 256 (and swung less), while shared memory is faster with the larger
    buckets (0.24 against 0.28 s): bench/weight_sync.py."""

    timeout_s: float = Field(default=60.0, gt=0)
    """distributed / tensor: longest wait for one bucket (or for the group to form) before the
    engine that did not take it is dropped from the sync and the sync counted as failed."""

    host: str = "127.0.0.1"
    """distributed: this trainer's address as the engines reach it (the group's rendezvous)."""


class TrainerConfig(Section):
    """`[trainer]`: what every step uses, and a table per concern."""

    model: Path | None = None
    """HF model directory training starts from (exports keep its config and tokenizer)."""

    groups_per_step: int = Field(default=8, ge=1)
    """Global batch: groups (prompts x samples) consumed by one optimizer step."""

    micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step's micro-batches."""

    max_tokens_per_micro_batch: int | None = Field(default=None, ge=2)
    """Pack sequences (first-fit by decreasing length) into micro-batches of at most this many
    tokens, one row each, attention kept inside each sequence, instead of `micro_batch_size`
    padded sequences: a batch of heavy-tailed episodes is then not mostly padding. A longer
    sequence is a micro-batch of its own. Unset: padded micro-batches."""

    max_staleness: int = Field(default=4, ge=0)
    """eta: train only on episodes sampled by a policy at most this many versions old."""

    staleness_measure: Literal["tokens", "oldest"] = "tokens"
    """What `max_staleness` bounds: each token (tokens sampled by a policy older than the bound
    do not train, the rest of the episode does, so long episodes that ran across weight updates
    are not thrown away), or each episode's oldest token (the rule before, which filters long
    episodes first; kept for comparison). See agent_rl/store/staleness.py."""

    stale_siblings: Literal["baseline", "drop_group"] = "baseline"
    """A group sibling all of whose tokens are older than the bound (a short episode that aged
    while a long sibling ran): "baseline" counts its reward in the group's advantage baseline
    and trains none of its tokens, so the group's fresh episodes still train; "drop_group" (the
    rule before) filters the whole group as stale. See agent_rl/store/staleness.py."""

    routing_replay: bool = True
    """MoE: train with the experts the rollout engine chose (R3) when episodes carry them."""

    dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the learner: fp32, or bf16 parameters and activations with fp32 master
    weights and optimizer state (logits, losses and logprobs in fp32). The train-vs-rollout
    logprob gap this opens is reported (`train_rollout_logprob_abs_diff`) and TIS weighs it."""

    seed: int = 0
    """Seed for initialisation-time randomness and data order."""

    threads: int = Field(default=1, ge=1)
    """torch CPU threads per rank (1 is fastest on a small shared machine)."""

    checkpoint_dir: Path = Path("runs/checkpoints")
    """Where dist_checkpointing checkpoints go (one folder per step); resume reads the latest."""

    checkpoint_every: int = Field(default=10, ge=1)
    """Checkpoint every k optimizer steps (and at shutdown)."""

    keep_checkpoints: int | None = Field(default=None, ge=1)
    """Keep the newest k checkpoints, deleting older ones once a newer one is complete (a
    checkpoint holds the optimizer's state too: ~4x the weights' size); unset: every one."""

    export_dir: Path = Path("runs/exports")
    """Where HF safetensors exports for the engines go (one folder per policy version)."""

    export_every: int = Field(default=1, ge=1)
    """Export weights and ask the router to reload them every k optimizer steps."""

    claim_lease_s: float = Field(default=300.0, gt=0)
    """Lease of a claim on ready groups; a trainer that dies holding one gives them back after it."""

    data_poll_s: float = Field(default=1.0, gt=0)
    """How often a trainer waiting for ready groups asks the store again."""

    tensorboard_dir: Path | None = Path("runs/tensorboard")
    """Where per-step TensorBoard scalars go (offline event files); unset: none."""

    optim: OptimConfig = OptimConfig()
    """Adam(W) of RL steps."""

    loss: LossConfig = LossConfig()
    """The policy loss and the advantage estimator."""

    parallel: ParallelConfig = ParallelConfig()
    """Tensor, pipeline and expert parallelism; the distributed optimizer."""

    mtp: MtpConfig = MtpConfig()
    """The multi-token-prediction draft."""

    eval: EvalConfig = EvalConfig()
    """Evaluations during training."""

    sft: SftConfig = SftConfig()
    """Supervised fine-tuning on demonstrations (`agent-rl train --sft`)."""

    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """How new weights reach the engines."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved(cls, data: Any) -> Any:
        moved_keys("trainer", data, TRAINER_MOVED)
        return data
