"""The export half of the weight sync, on every actor rank: gather the live weights and hand them to a sink.

A sink is rank 0's delivery session (`sync.delivery`) or, on every other rank, `NullSink`:

    sink.load_from_disk(path, version)     # DiskExport: after the HF directory is complete
    sink.send(bucket, last=...)            # DistributedExport: each bucket of (hf_name, full tensor)

Both exports are collective over all actor ranks (TP all-gathers, PP gathers to stage 0) and never
talk HTTP; what reaches the servers, and how, is the sink's business.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import torch

from megatron_bapo.sync.config import SyncConfig

logger = logging.getLogger(__name__)


class Sink(Protocol):
    """What an export hands its result to (rank 0: `delivery.UpdateSession`; others: `NullSink`)."""

    def load_from_disk(self, path: Path, version: int) -> None: ...

    def send(self, bucket: list, *, last: bool) -> int: ...


class NullSink:
    """Ranks above 0: they take part in the gathers; the servers are rank 0's."""

    def load_from_disk(self, path: Path, version: int) -> None:
        return None

    def send(self, bucket: list, *, last: bool) -> int:
        return 0


class DiskExport:
    """Write `root/v{version:06d}` (HF safetensors, renamed into place when complete), then the sink
    loads it; directories beyond `sync.keep_versions` are deleted."""

    def __init__(self, config: SyncConfig, actor: Any, hf_config: Any, root: Union[str, Path], *,
                 tokenizer_src: Optional[Union[str, Path]] = None) -> None:
        self.config, self.actor, self.hf_config = config, actor, hf_config
        self.root = Path(root)
        self.tokenizer_src = tokenizer_src

    def run(self, version: int, sink: Sink) -> None:
        from megatron_bapo.convert import save_model_as_hf

        target = self.root / f"v{version:06d}"
        written = save_model_as_hf(self.actor.model, self.hf_config, target, tokenizer_src=self.tokenizer_src,
                                   max_shard_bytes=int(self.config.bucket_bytes), parallel=self.actor.parallel)
        if written is None:  # not the writing rank: the directory is rank 0's to deliver
            return
        sink.load_from_disk(written, version)
        versions = sorted(p for p in self.root.glob("v*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in versions[:-self.config.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)


class DistributedExport:
    """HF-named buckets of <= `sync.bucket_bytes` from the first DP/CP replica (other replicas hold
    identical weights and skip, except, with expert parallelism, the ranks holding the experts the
    first replica lacks, which take part in the gather); one bucket of look-ahead tells the sink
    which bucket is the last (it carries the version and the cache flush)."""

    def __init__(self, config: SyncConfig, actor: Any, hf_config: Any) -> None:
        self.config, self.actor, self.hf_config = config, actor, hf_config
        if config.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("sync.backend='nccl' needs CUDA; use sync.backend=gloo on CPU")

    def run(self, version: int, sink: Sink) -> int:
        from megatron_bapo.convert import iter_hf_tensors

        p = self.actor.parallel
        if not p.exports_weights:
            return 0
        if not p.first_replica:  # an expert-parallel peer: its experts go into the first replica's buckets
            sink = NullSink()
        # NCCL moves GPU memory only; gathered tensors may sit on the CPU.
        device = torch.device("cuda", torch.cuda.current_device()) if self.config.backend == "nccl" else torch.device("cpu")
        buckets = iter_hf_tensors(self.actor.model, self.hf_config, bucket_bytes=int(self.config.bucket_bytes),
                                  gather_to="first", tp_group=p.tp_group, pp_group=p.pp_group,
                                  etp_group=p.etp_group, ep_group=p.ep_group)
        sent, held = 0, None
        for bucket in buckets:
            if held is not None:
                sent += sink.send(held, last=False)
            held = [(name, t.to(device)) for name, t in bucket]
        if held is not None:
            sent += sink.send(held, last=True)
        return sent


def make_export(config: SyncConfig, actor: Any, hf_config: Any, output_dir: Path, *,
                tokenizer_src: Optional[Union[str, Path]] = None) -> Union[DiskExport, DistributedExport]:
    """The export of `sync.method` (every rank builds the same one)."""
    if config.method == "distributed":
        return DistributedExport(config, actor, hf_config)
    return DiskExport(config, actor, hf_config, output_dir / "hf_sync", tokenizer_src=tokenizer_src)
