"""Config of the Megatron-core trainer (`agent-rl train`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from agent_rl.config.base import Section


class TrainerConfig(Section):
    model: Path | None = None
    """HF model directory training starts from (exports keep its config and tokenizer)."""

    lr: float = Field(default=3e-5, gt=0)
    """Adam learning rate for RL (3e-5 suits the tiny models; 1e-3 or 3e-4 collapsed them)."""

    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps over which the learning rate ramps linearly up to `lr`."""

    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam beta1."""

    adam_beta2: float = Field(default=0.99, ge=0, lt=1)
    """Adam beta2."""

    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (AdamW style)."""

    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    loss_type: Literal["grpo", "gspo", "ppo"] = "grpo"
    """grpo: token-level PPO-clip on group-normalised advantages; gspo: sequence-level ratios
    (GSPO); ppo: token-level PPO-clip on the advantages as given."""

    clip_eps_low: float = Field(default=0.2, ge=0)
    """Lower clip range: ratios below 1 - clip_eps_low stop pushing (GSPO: ~3e-4)."""

    clip_eps_high: float = Field(default=0.28, ge=0)
    """Upper clip range: ratios above 1 + clip_eps_high stop pushing (GSPO: ~4e-4)."""

    advantage_std_normalize: bool = True
    """Divide group-centred rewards by the group's std (off: Dr. GRPO style, centring only)."""

    tis_cap: float | None = Field(default=2.0, gt=0)
    """Truncated importance sampling: weight tokens by min(pi_train / pi_rollout, cap) to
    correct train/inference mismatch and staleness; unset disables it."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (starting) policy; 0 skips the reference."""

    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses become the step's loss."""

    micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step's micro-batches."""

    max_tokens_per_micro_batch: int | None = Field(default=None, ge=2)
    """Pack sequences (first-fit by decreasing length) into micro-batches of at most this many
    tokens, one row each, attention kept inside each sequence, instead of `micro_batch_size`
    padded sequences: a batch of heavy-tailed episodes is then not mostly padding. A longer
    sequence is a micro-batch of its own. Unset: padded micro-batches."""

    groups_per_step: int = Field(default=8, ge=1)
    """Global batch: groups (prompts x samples) consumed by one optimizer step."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size."""

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size: each of pp stages holds num_layers / pp decoder layers and
    megatron's 1F1B schedule runs the micro-batches through them (not with `mtp_layers`)."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE models)."""

    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""

    routing_replay: bool = True
    """MoE: train with the experts the rollout engine chose (R3) when episodes carry them."""

    checkpoint_dir: Path = Path("runs/checkpoints")
    """Where dist_checkpointing checkpoints go (one folder per step); resume reads the latest."""

    checkpoint_every: int = Field(default=10, ge=1)
    """Checkpoint every k optimizer steps (and at shutdown)."""

    export_dir: Path = Path("runs/exports")
    """Where HF safetensors exports for the engines go (one folder per policy version)."""

    export_every: int = Field(default=1, ge=1)
    """Export weights and ask the router to reload them every k optimizer steps."""

    max_staleness: int = Field(default=4, ge=0)
    """eta: train only on episodes sampled by a policy at most this many versions old."""

    staleness_measure: Literal["tokens", "oldest"] = "tokens"
    """What `max_staleness` bounds: each token (tokens sampled by a policy older than the bound
    do not train, the rest of the episode does, so long episodes that ran across weight updates
    are not thrown away), or each episode's oldest token (the rule before, which filters long
    episodes first; kept for comparison). See agent_rl/store/staleness.py."""

    router_url: str | None = None
    """Router (or single SGLang server) the weights are synced through (`weight_sync`);
    unset: `rollout.router_url`; neither: weights are exported but not synced."""

    weight_sync: Literal["disk", "distributed", "tensor"] = "disk"
    """How new weights reach the engines after a step: disk (every engine loads the step's HF
    export), distributed (a broadcast over a process group of this trainer and every engine:
    gloo on CPU, NCCL on GPU), tensor (tensors in shared memory: engines on this host only).
    In-memory modes sync after every step; exports are still written every `export_every`."""

    weight_sync_bucket_mb: float | None = Field(default=None, gt=0)
    """distributed / tensor: weights travel in buckets of at most this many MB (one broadcast
    or one update call each; a larger tensor travels alone). Unset: 64 for a gloo broadcast
    (CPU), 256 otherwise; measured on a 105M model's CPU push, 64 MB broadcasts took 0.52 s
    against 0.68 at 256 (and swung less), while shared memory is faster with the larger
    buckets (0.24 against 0.28 s): bench/weight_sync.py."""

    weight_sync_timeout_s: float = Field(default=60.0, gt=0)
    """distributed / tensor: longest wait for one bucket (or for the group to form) before the
    engine that did not take it is dropped from the sync and the sync counted as failed."""

    weight_sync_host: str = "127.0.0.1"
    """distributed: this trainer's address as the engines reach it (the group's rendezvous)."""

    claim_lease_s: float = Field(default=300.0, gt=0)
    """Lease of a claim on ready groups; a trainer that dies holding one gives them back after it."""

    data_poll_s: float = Field(default=1.0, gt=0)
    """How often a trainer waiting for ready groups asks the store again."""

    tensorboard_dir: Path | None = Path("runs/tensorboard")
    """Where per-step TensorBoard scalars go (offline event files); unset: none."""

    eval_every: int = Field(default=0, ge=0)
    """Evaluate every k policy versions (`agent-rl eval` of that version's export, in a process
    of its own, while rollout and training go on); 0: never."""

    eval_tasks: int = Field(default=64, ge=1)
    """Tasks of each `eval_every` evaluation (the split's first ones)."""

    eval_samples: int = Field(default=4, ge=1)
    """Episodes per task of each `eval_every` evaluation."""

    eval_env: str | None = None
    """Environment of the `eval_every` evaluations; unset: `rollout.env`."""

    eval_split: str = "eval"
    """Task split of the `eval_every` evaluations."""

    eval_seed: int = 1234
    """Seed of the `eval_every` evaluations (task order and every request's sampling seed)."""

    eval_nice: int = Field(default=10, ge=0, le=19)
    """CPU niceness of each `eval_every` evaluation (its process and the engine it starts): on
    a host that also runs rollout and training, evaluations take the spare CPU, not theirs."""

    eval_cpu_idle: bool = True
    """Run each `eval_every` evaluation (its process and the engine it starts) under Linux's
    SCHED_IDLE: it gets a core only when rollout and training leave it idle (niceness alone
    still gives it a weighted share of a busy core). On a saturated host an evaluation then
    waits for spare CPU. Elsewhere than Linux, `eval_nice` alone. Either way the evaluator's
    session (Linux schedules each session as a group, agent_rl/kernel/priority.py) gets the same
    lower priority."""

    eval_router_url: str | None = None
    """Engines the `eval_every` evaluations load their weights on (a fleet of their own: the
    training fleet keeps serving the newest policy); unset: each starts an engine of its own."""

    sft_lr: float = Field(default=1e-3, gt=0)
    """Learning rate of `agent-rl train --sft` (cross-entropy on demonstration tokens)."""

    sft_steps: int = Field(default=1000, ge=1)
    """Optimizer steps of an SFT run."""

    sft_batch_size: int = Field(default=16, ge=1)
    """Demonstration transcripts per SFT optimizer step."""

    sft_demos: int = Field(default=4096, ge=1)
    """Distinct demonstrations an SFT run draws (then cycles through): enough that a small model
    learns the skill rather than memorising the transcripts."""

    seed: int = 0
    """Seed for initialisation-time randomness and data order."""

    dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the learner: fp32, or bf16 parameters and activations with fp32 master
    weights and optimizer state (logits, losses and logprobs in fp32). The train-vs-rollout
    logprob gap this opens is reported (`train_rollout_logprob_abs_diff`) and TIS weighs it."""

    mtp_layers: int = Field(default=0, ge=0)
    """Multi-token prediction draft modules (megatron-core MTP) trained with the policy and
    exported as the draft SGLang serves for the model (it serves the first): a Qwen3-MoE's
    `Qwen3MoeForCausalLMMTP` (`mtp.*` weights), a dense Qwen2/Qwen3's EAGLE draft
    (`Qwen2ForCausalLMEagle`, the export's `draft/`); 0: none."""

    mtp_ffn_hidden_size: int | None = Field(default=None, ge=1)
    """Width of the MTP draft layer's MLP (a dense model's EAGLE draft, whose `draft/config.json`
    carries it as `intermediate_size`); None: the model's. A narrower draft costs the learner
    and the engine less per token: the draft is one decoder layer, so beside a shallow model it
    is a large share of a step (bench/mtp.py). A Qwen3-MoE's MTP draft is the model's own layer
    (SGLang builds it from the target's config): refused there."""

    mtp_num_attention_heads: int | None = Field(default=None, ge=1)
    """Query heads of the MTP draft layer's attention (a dense model's EAGLE draft), each the
    model's head_dim wide, with as many key/value heads as the model has or as the draft has
    query heads where those are fewer (they must divide them); `draft/config.json` carries them
    (`num_attention_heads`, `num_key_value_heads`, `head_dim`). None: the model's. Fewer heads
    cut the attention's share of the draft's cost, which grows with the context; on the
    quickstart's short episodes one head saved 0.01-0.03 of a step and followed the policy less
    closely (bench/mtp.py). Refused for a Qwen3-MoE, as `mtp_ffn_hidden_size` is."""

    mtp_loss_coef: float = Field(default=1.0, ge=0)
    """Weight of the MTP loss (each depth's `mtp_objective` over the policy's own sampled tokens,
    averaged over depths) added to each step's loss."""

    mtp_objective: Literal["nll", "kl", "tv"] = "nll"
    """The MTP loss of RL steps, per policy token each depth's draft predicts: `nll`, the
    cross-entropy of the sampled token (slime's MTP loss); `kl`, the forward KL divergence from
    the policy's whole distribution there (the nll's expectation over samples, without their
    noise); `tv`, the total variation distance to it, which is one minus the expected acceptance
    under speculative sampling, the quantity measured (DistillSpec's choice; bench/mtp.py).
    SFT steps train the draft with `nll` on the demonstrations' tokens."""

    mtp_lr: float | None = Field(default=None, gt=0)
    """Learning rate of the MTP modules in RL steps (Adam, with `lr_warmup_steps`); None: the
    policy's `lr`. The draft's loss is its own (detached, it never steers the policy), so it
    can learn at an SFT-like rate while the policy keeps RL's small one: at RL's rate a draft
    barely moves in a run and does not follow the policy (bench/mtp.py). SFT steps train the
    draft at `sft_lr`, with the policy."""

    mtp_detach: bool = True
    """Train the MTP modules on detached trunk hidden states, embeddings and output weight, so
    the draft follows the policy and never steers it; false: the MTP loss also trains the trunk."""

    mtp_train: bool = True
    """Update the MTP modules; false: a frozen draft (its weights stay those loaded from the
    model directory, e.g. an SFT export's `mtp.*`), whose loss and acceptance are still reported
    but whose loss is not added to the step's: the policy trains as without MTP."""

    threads: int = Field(default=1, ge=1)
    """torch CPU threads per rank (1 is fastest on a small shared machine)."""
