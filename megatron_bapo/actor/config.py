"""Actor configuration: one nested dataclass per concern, validated at construction (fields named)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_bapo.actor.mismatch import MismatchConfig
from megatron_bapo.algorithms import BapoConfig, CispoConfig, DppoConfig, Objective, SapoConfig
from megatron_bapo.algorithms.importance import CorrectionConfig
from megatron_bapo.algorithms.checks import check_objective
from megatron_bapo.algorithms.policy_loss import AGG_MODES
from megatron_bapo.models.layer_spec import LAYER_SPECS
from megatron_bapo.models.parallel import ParallelConfig

SEARCH_SCOPES = ("minibatch", "microbatch")
LOSS_AGGS = AGG_MODES
RECOMPUTE_MODES = ("none", "selective", "full")
OLD_LOGPROBS = ("rollout", "recompute")


@dataclass
class OptimConfig:
    """Optimizer and LR schedule (megatron `get_megatron_optimizer` + `OptimizerParamScheduler`)."""

    name: str = "adam"
    """"adam" (AdamW, decoupled weight decay) or "sgd"."""
    lr: float = 1e-6
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    decay_style: str = "constant"
    """"constant", "cosine" or "linear" (decay from `lr` to `min_lr` over `decay_steps`)."""
    decay_steps: Optional[int] = None
    """Optimizer steps of the schedule including warmup; required for cosine/linear."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""

    def __post_init__(self) -> None:
        if self.name not in ("adam", "sgd"):
            raise ValueError(f"OptimConfig.name must be 'adam' or 'sgd', got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"OptimConfig.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"OptimConfig.decay_style must be constant/cosine/linear, got {self.decay_style!r}")
        if self.decay_style != "constant" and (self.decay_steps is None or self.decay_steps <= self.warmup_steps):
            raise ValueError(
                f"OptimConfig.decay_steps must be set and > warmup_steps ({self.warmup_steps}) for "
                f"decay_style={self.decay_style!r}, got {self.decay_steps}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ValueError(f"OptimConfig.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass
class ActorConfig:
    """Everything the Megatron actor needs; the trainer builds it from the run's YAML."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    bapo: BapoConfig = field(default_factory=BapoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    max_tokens_per_microbatch: int = 8192
    """Token budget per micro-batch, counted before the context-parallel split (packed: the summed
    lengths; padded: sequences x padded length); a sequence longer than it goes alone."""
    packing: bool = True
    """Pack each micro-batch's sequences into one row without padding (THD: `cu_seqlens`,
    megatron-core `PackedSeqParams`; attention stays within each sequence). False: right-pad every
    sequence of a micro-batch to its longest."""
    n_minibatches: int = 1
    """Optimizer steps per pass over the batch (the batch size must be divisible by it)."""
    ppo_epochs: int = 1
    """Passes over the batch per train_step."""
    search_scope: str = "minibatch"
    """"minibatch": bounds from a forward-only pass over the whole mini-batch (exact);
    "microbatch": bounds decided per micro-batch inside the loss (official recipe; no extra pass)."""
    loss_agg: str = "token-mean"
    use_distributed_optimizer: bool = True
    """Megatron distributed optimizer (optimizer state sharded over DP x CP), on CPU too; Adam only
    (megatron-core refuses SGD with it). Checkpoints resume exactly (see actor.distopt_state)."""
    seed: int = 1234
    dtype: str = "float32"
    """Parameter dtype: "float32" or "bfloat16" (bf16 needs CUDA)."""
    logprob_chunk_size: int = 4096
    """Tokens per chunk in the vocab-parallel log-prob/entropy computation."""
    vocab_divisible_by: int = 128
    """Vocabulary padding multiple (TP-independent; see models.registry)."""
    max_skipped_steps: int = 10
    """Non-finite loss/grad steps tolerated (each is skipped and counted) before raising."""
    layer_spec: str = "auto"
    """Transformer layer implementation: "te" (Transformer Engine: fused attention, THD packing, ring
    context parallel; needs CUDA), "local" (megatron-core local modules with torch SDPA attention:
    dense masks, all-gather context parallel; runs anywhere), or "auto" (TE when CUDA is present and
    TE imports; TE installed but failing to import is an error with TE's message). The actor logs
    which one runs."""
    old_logprobs: str = "rollout"
    """The old policy PPO's ratio and clip are taken against: "rollout" (the behavior log-probs the
    servers returned; the paper's and this project's default) or "recompute" (the trainer's own
    log-probs at the start of the step, one forward-only pass over the batch that the first
    mini-batch's search pass reuses, as verl and AReaL's decoupled PPO do; the behavior log-probs then
    enter only through `correction`). docs/bapo.md, "Training-inference mismatch"."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """With `old_logprobs: recompute`: the importance correction (`mode`: none | tis | mis | seq_mis,
    `tis_cap`, `band`) that multiplies each token's loss term and bound-search contribution."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """The `mismatch/*` metrics' ratio band and the first update's warning threshold."""
    recompute: str = "none"
    """Activation recomputation: "none"; "selective" (megatron's core-attention recompute); "full"
    (every layer, uniform, 1 layer per checkpoint: keeps only each layer's input, the planner's
    `activations_recompute`). 64k-token sequences on a 32B model need "full"."""
    routing_replay: bool = False
    """Mixture-of-experts models: force, in every forward of a step (bound search, loss, recompute,
    log-probs), the experts the rollout server chose for each token (rollout routing replay; the
    batch's `routed_experts`, which needs `rollout.return_routed_experts`). Off: the router's own
    choice, and `moe/routing_mismatch` reports how often it differs from the rollout's."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of megatron's load-balancing loss on the router (the
    `aux_loss` type); 0 = off, as RL recipes run it (the reward, not balance, should move the
    router). `moe/load_balance` logs the balance either way."""
    policy_loss: str = "ppo_clip"
    """The policy loss: "ppo_clip" (PPO's clip with dual clip, BAPO's bounds), "dppo" (a divergence
    trust region, `dppo`), "cispo" (a clipped stop-gradient importance weight, `cispo`) or "sapo"
    (soft gates, `sapo`). An adaptive `bapo` moves DPPO's thresholds and CISPO's cap to BAPO's balance
    (docs/bapo.md, "Other policy losses"); TIS / MIS corrections multiply every loss's terms."""
    dppo: DppoConfig = field(default_factory=DppoConfig)
    """DPPO's divergence, thresholds, importance-weight cap and balance grid (`policy_loss: dppo`)."""
    cispo: CispoConfig = field(default_factory=CispoConfig)
    """CISPO's importance-weight bounds (`policy_loss: cispo`)."""
    sapo: SapoConfig = field(default_factory=SapoConfig)
    """SAPO's gate temperatures (`policy_loss: sapo`)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: responses that hit `rollout.max_response_tokens` (truncated) are
    masked out of the loss and its denominator (their group's advantages still count them);
    `actor/overlong_filtered_frac` logs the share of rows masked."""

    @property
    def objective(self) -> Objective:
        """The policy loss with its configs (`algorithms.objective`)."""
        return Objective(self.policy_loss, bapo=self.bapo, dppo=self.dppo, cispo=self.cispo, sapo=self.sapo)

    def recompute_overrides(self) -> dict:
        """The megatron-core `TransformerConfig` fields for `recompute`."""
        if self.recompute == "full":
            return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if self.recompute == "selective":
            return {"recompute_granularity": "selective"}
        return {}

    def __post_init__(self) -> None:
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if isinstance(self.bapo, dict):
            self.bapo = BapoConfig(**self.bapo)
        if isinstance(self.parallel, dict):
            self.parallel = ParallelConfig(**self.parallel)
        if isinstance(self.correction, dict):
            self.correction = CorrectionConfig(**self.correction)
        if isinstance(self.mismatch, dict):
            self.mismatch = MismatchConfig(**self.mismatch)
        for name, cls in (("dppo", DppoConfig), ("cispo", CispoConfig), ("sapo", SapoConfig)):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, cls(**getattr(self, name)))
        check_objective(self.policy_loss, self.bapo, self.dppo, self.cispo, prefix="actor.")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"ActorConfig.max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.n_minibatches < 1:
            raise ValueError(f"ActorConfig.n_minibatches must be >= 1, got {self.n_minibatches}")
        if self.ppo_epochs < 1:
            raise ValueError(f"ActorConfig.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.search_scope not in SEARCH_SCOPES:
            raise ValueError(f"ActorConfig.search_scope must be one of {SEARCH_SCOPES}, got {self.search_scope!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"ActorConfig.loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ActorConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"ActorConfig.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"ActorConfig.layer_spec must be one of {LAYER_SPECS}, got {self.layer_spec!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"ActorConfig.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.correction.mode != "none" and self.old_logprobs != "recompute":
            raise ValueError(
                f"ActorConfig.correction.mode={self.correction.mode!r} needs old_logprobs='recompute' (with 'rollout' "
                "the ratio is already taken against the behavior log-probs); set actor.old_logprobs: recompute or "
                "actor.correction.mode: none"
            )
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"ActorConfig.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.parallel.vpp and not self.packing:
            raise ValueError(
                f"ActorConfig.parallel.vpp={self.parallel.vpp} needs packing=True: interleaved pipeline schedules "
                "exchange one fixed micro-batch shape, which the actor builds by padding packed micro-batches"
            )
        if self.use_distributed_optimizer and self.optim.name != "adam":
            raise ValueError(
                f"ActorConfig.use_distributed_optimizer=True needs OptimConfig.name='adam' (megatron-core's "
                f"distributed optimizer supports only Adam), got {self.optim.name!r}; "
                "set use_distributed_optimizer=False"
            )
        if self.max_skipped_steps < 0:
            raise ValueError(f"ActorConfig.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"ActorConfig.moe_aux_loss_coeff must be >= 0, got {self.moe_aux_loss_coeff}")
