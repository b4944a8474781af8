"""The export half of the weight sync, on every actor rank: gather the live weights and hand them to a sink.

A sink is rank 0's update session (`rollout.pool.ServerPool.update`) or, on every other rank, `NullSink`:

    sink.load_from_disk(path, version)     # DiskExport: after the HF directory is complete
    sink.send(bucket, last=...)            # DistributedExport: each bucket of (hf_name, full tensor)

Both exports are collective over all actor ranks (TP all-gathers, PP gathers to stage 0) and never
talk HTTP; what reaches the servers, and how, is the sink's business.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

import torch

from megatron_bapo.sync.config import SyncConfig

logger = logging.getLogger(__name__)
_VERSION_DIR = re.compile(r"^v(\d+)(\.tmp|\.old)?$")


class ExportWriteError(RuntimeError):
    """The disk export could not write a version (a full disk, a quota): one line naming the path and
    the space left (the trainer adds where `--resume` continues); the partial version is gone."""


class Sink(Protocol):
    """What an export hands its result to (rank 0: `rollout.pool.UpdateSession`; others: `NullSink`)."""

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
    loads it; the directories are owned by version number, not guessed from their names' order.

    Before writing version V, every directory of a version above V is deleted: after a resume from
    a checkpoint at V, the killed run's later versions are not this run's weights (and sorted by
    name they would outrank V, so the version just published would be the one pruned). After the
    sink loaded V, the `sync.keep_versions` newest versions up to V are kept, older ones deleted.
    """

    def __init__(self, config: SyncConfig, actor: Any, hf_config: Any, root: Union[str, Path], *,
                 tokenizer_src: Optional[Union[str, Path]] = None) -> None:
        self.config, self.actor, self.hf_config = config, actor, hf_config
        self.root = Path(root)
        self.tokenizer_src = tokenizer_src

    def run(self, version: int, sink: Sink) -> None:
        from megatron_bapo.convert import save_model_as_hf

        p = self.actor.parallel
        if p.dp_rank == 0 and p.cp_rank == 0 and p.tp_rank == 0 and p.pp_rank == 0:  # save_model_as_hf's writer
            self._delete(lambda v: v > version, why=f"newer than version {version}, which is being published")
        target = self.root / f"v{version:06d}"
        try:
            written = save_model_as_hf(self.actor.model, self.hf_config, target, tokenizer_src=self.tokenizer_src,
                                       max_shard_bytes=int(self.config.bucket_bytes), parallel=self.actor.parallel)
        except Exception as exc:
            raise self._write_failure(target, version, exc) or exc
        if written is None:  # not the writing rank: the directory is rank 0's to deliver
            return
        sink.load_from_disk(written, version)
        kept = sorted(v for v in self.versions() if v <= version)[-self.config.keep_versions:]
        self._delete(lambda v: v not in kept)  # older than sync.keep_versions (routine)

    def _write_failure(self, target: Path, version: int, exc: BaseException) -> Optional["ExportWriteError"]:
        """A write that failed (a full disk, a quota; every rank raises, the writer its own error):
        the partial version is removed and the error names it and the space left; None for any other
        error (a bug: re-raised as is)."""
        from megatron_bapo import run_state

        tmp = target.with_name(target.name + ".tmp")
        full = run_state.out_of_space(tmp, exc)  # measured before the partial version is removed
        cause = run_state.write_failure_of(exc) or (str(full) if full is not None else None)
        if cause is None:
            return None
        for path in (tmp, target):
            shutil.rmtree(path, ignore_errors=True)
        free = run_state.free_bytes(target)
        return ExportWriteError(f"writing weight version {version} to {target} failed: {cause}; {free} bytes "
                                f"({free / 2**20:.1f} MiB) are free there after removing the partial version")

    def versions(self) -> dict[int, Path]:
        """Complete version directories under the root: {version: path} (`v000012` is version 12)."""
        found = {}
        for path in self.root.glob("v*"):
            m = _VERSION_DIR.match(path.name)
            if m and m.group(2) is None and path.is_dir():
                found[int(m.group(1))] = path
        return found

    def _delete(self, doomed: Callable[[int], bool], why: Optional[str] = None) -> None:
        """Delete version directories (and their interrupted `.tmp`/`.old` siblings) whose version
        `doomed(version)` selects; logged when `why` says it is not routine pruning."""
        for path in sorted(self.root.glob("v*")):
            m = _VERSION_DIR.match(path.name)
            if m and path.is_dir() and doomed(int(m.group(1))):
                if why:
                    logger.info("weight sync: deleting %s (%s)", path, why)
                shutil.rmtree(path, ignore_errors=True)


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
