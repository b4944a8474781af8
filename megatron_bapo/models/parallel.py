"""Parallel layout (TP, PP, CP, EP; DP derived) and the process groups the actor passes around.

megatron-core keeps its groups in module globals (`parallel_state`); we initialise them once from a
`ParallelConfig` and hand the groups that a piece of code needs to it explicitly (`ParallelGroups`),
so no BAPO code reaches for the world group by accident (style rule 3).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """How the actor's ranks are laid out. DP is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size; must divide the number of attention heads and KV heads."""
    pp: int = 1
    """Pipeline-parallel size; must divide the number of layers."""
    cp: int = 1
    """Context-parallel size: each sequence is split into 2*cp chunks, CP rank i holding chunks i
    and 2*cp-1-i (TE attention on GPUs; an all-gather attention on CPU)."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None = plain 1F1B."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each rank holds num_experts / ep experts of
    every MoE layer and tokens travel to their experts by all-to-all. Carved out of the data
    (x context x tensor) parallel ranks of a pipeline stage: ep * etp must divide
    world_size / pp; must divide the number of experts."""
    etp: Optional[int] = None
    """Expert-tensor-parallel size: each expert's weights split over this many ranks. None = tp
    (megatron's default); 1 keeps every expert whole (the usual choice with ep > 1)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP split over the TP ranks
    along the sequence (needs tp > 1)."""
    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with CUDA, gloo without), "gloo" or "nccl"."""
    timeout_minutes: int = 30
    """Collective timeout for the process groups."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"ParallelConfig.etp must be an integer >= 1 or null, got {self.etp!r}")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(f"ParallelConfig.vpp must be None or >= 2 with pp >= 2, got vpp={self.vpp}, pp={self.pp}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"ParallelConfig.backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelConfig.sequence_parallel needs tp > 1")
        if self.timeout_minutes <= 0:
            raise ValueError(f"ParallelConfig.timeout_minutes must be > 0, got {self.timeout_minutes}")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """The expert-tensor-parallel size in effect (`etp`, or `tp` when unset)."""
        return self.tp if self.etp is None else self.etp

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; raises naming the fields when it does not divide."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"ParallelConfig: world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}"
            )
        experts = self.ep * self.expert_tp * self.pp
        if world_size % experts:
            raise ValueError(
                f"ParallelConfig: world size {world_size} is not divisible by ep*etp*pp = "
                f"{self.ep}*{self.expert_tp}*{self.pp} = {experts} (expert parallelism uses the ranks of a "
                f"pipeline stage); lower ParallelConfig.ep or ParallelConfig.etp"
            )
        return world_size // self.model_parallel_size

    def validate_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int) -> None:
        """Check this layout against a model's shape; errors name the field to change."""
        if num_attention_heads % self.tp:
            raise ValueError(
                f"ParallelConfig.tp={self.tp} must divide the number of attention heads ({num_attention_heads})"
            )
        if num_query_groups % self.tp:
            raise ValueError(
                f"ParallelConfig.tp={self.tp} must divide the number of KV heads (num_key_value_heads="
                f"{num_query_groups})"
            )
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ValueError(
                f"ParallelConfig.pp={self.pp} (x vpp={self.vpp or 1}) must divide the number of layers ({num_layers})"
            )


@dataclass
class ParallelGroups:
    """The process groups and ranks of this process, passed explicitly to code that communicates."""

    config: ParallelConfig
    world_size: int
    rank: int
    tp_group: "dist.ProcessGroup"
    pp_group: "dist.ProcessGroup"
    dp_group: "dist.ProcessGroup"
    """Data-parallel group without CP (gradient reduction of non-CP params is over dp x cp in megatron)."""
    dp_cp_group: "dist.ProcessGroup"
    """Data x context parallel group: holds the rest of a mini-batch's tokens (bound search, token counts)."""
    cp_group: "dist.ProcessGroup"
    """Context-parallel group: the ranks holding the other chunks of the same sequences."""
    mp_group: "dist.ProcessGroup"
    world_group: "dist.ProcessGroup"
    """Every actor rank (decisions all ranks must share: skipped steps, checkpoint barriers)."""
    ep_group: Optional["dist.ProcessGroup"] = None
    """Expert-parallel group: the ranks holding the other experts of this rank's MoE layers."""
    etp_group: Optional["dist.ProcessGroup"] = None
    """Expert-tensor-parallel group: the ranks holding the other parts of this rank's experts."""
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    expert_dp_rank: int = 0
    """Rank among the replicas of this rank's experts (0: the copy every weight export reads)."""
    extra: dict = field(default_factory=dict)

    @property
    def first_replica(self) -> bool:
        """Data- and context-parallel rank 0: this rank's dense weights are the ones to export."""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def exports_weights(self) -> bool:
        """Takes part in gathering the weights for an export: the first replica, and with expert
        parallelism the ranks holding the first copy of the experts the first replica lacks (its
        expert-parallel peers sit on other data-parallel ranks). Closed under the TP, PP and EP groups."""
        return self.first_replica or (self.ep_size > 1 and self.expert_dp_rank == 0)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a rendezvous this process hosts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_ONE_RANK_STORE: Any = None  # the rendezvous store of a plain `python ...` run, held from the start


def init_distributed_env() -> None:
    """Let a plain `python ...` run as a one-rank job (torchrun/srun set these themselves).

    Its rendezvous store listens on a port the OS picks and keeps it: a port looked up free and bound
    later can be taken in between by any other process on the machine (parallel test workers, the
    rollout servers' client sockets), and the run then dies at start with EADDRINUSE.
    """
    global _ONE_RANK_STORE
    if "RANK" in os.environ:
        return
    _ONE_RANK_STORE = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(minutes=5))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_ONE_RANK_STORE.port))


def initialize_model_parallel(cfg: ParallelConfig, *, seed: int = 1234) -> ParallelGroups:
    """Initialise torch.distributed (if needed) and megatron's groups for `cfg`; seed the RNG tracker.

    Uses the env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun/srun set
    them) when torch.distributed is not initialised yet. Idempotent for the same layout.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_bapo.models import cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.install()
    if not dist.is_initialized():
        backend = cfg.resolved_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(minutes=cfg.timeout_minutes)
        store = _ONE_RANK_STORE if os.environ.get("MASTER_PORT") == str(getattr(_ONE_RANK_STORE, "port", None)) else None
        if store is not None:
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    world_size = dist.get_world_size()
    cfg.dp_size(world_size)  # validates divisibility
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != cfg.tp
            or ps.get_pipeline_model_parallel_world_size() != cfg.pp
            or ps.get_context_parallel_world_size() != cfg.cp
            or ps.get_expert_model_parallel_world_size() != cfg.ep
            or ps.get_expert_tensor_parallel_world_size() != cfg.expert_tp
        ):
            raise RuntimeError(
                "initialize_model_parallel: megatron parallel state already initialised with a different layout; "
                "call megatron.core.parallel_state.destroy_model_parallel() first"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            virtual_pipeline_model_parallel_size=cfg.vpp,
            context_parallel_size=cfg.cp,
            expert_model_parallel_size=cfg.ep,
            expert_tensor_parallel_size=cfg.etp,
            distributed_timeout_minutes=cfg.timeout_minutes,
            create_gloo_process_groups=True,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = current_groups(cfg)
    logger.info(
        "parallel layout: world=%d tp=%d pp=%d cp=%d ep=%d etp=%d dp=%d (rank %d: tp_rank=%d pp_rank=%d dp_rank=%d "
        "ep_rank=%d)", groups.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.expert_tp, groups.dp_size, groups.rank,
        groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.ep_rank,
    )
    return groups


def current_groups(cfg: Optional[ParallelConfig] = None) -> ParallelGroups:
    """megatron's initialised parallel state as `ParallelGroups`: the one place that reads its globals.

    Code that holds an actor passes `actor.parallel`; this is for tools and tests that build bare
    model chunks after `initialize_model_parallel`. `cfg` defaults to the sizes megatron holds.
    """
    from megatron.core import parallel_state as ps

    if cfg is None:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        cfg = ParallelConfig(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                             cp=ps.get_context_parallel_world_size(), vpp=vpp if vpp and vpp > 1 else None,
                             ep=ps.get_expert_model_parallel_world_size(),
                             etp=ps.get_expert_tensor_parallel_world_size())
    return ParallelGroups(
        config=cfg,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_group=ps.get_context_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        world_group=dist.group.WORLD,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
    )
