"""Weight sync through a shared file system: HF safetensors + `/update_weights_from_disk`.

All actor ranks gather the weights (`convert.save_model_as_hf`; the writer renames a complete
`vNNNNNN.tmp` directory into place, so a server never reads a partial one); rank 0 then posts
`{"model_path", "weight_version"}` to every server and awaits all replies. Older version
directories beyond `keep_versions` are deleted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_bapo.sync.http import ControlCalls

logger = logging.getLogger(__name__)


class DiskWeightSync:
    """`sync(version)` writes `root/v{version:06d}` and makes every server load it."""

    def __init__(
        self,
        config: Any,
        actor: Any,
        hf_config: Any,
        root: str | Path,
        *,
        server_urls: Optional[Sequence[str]] = None,
        tokenizer_src: Optional[str | Path] = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self.actor = actor
        self.hf_config = hf_config
        self.root = Path(root)
        self.urls = [u.rstrip("/") for u in (server_urls or [])]
        self.tokenizer_src = tokenizer_src
        self.timeout_s = timeout_s
        self.is_driver = actor.parallel.rank == 0
        self._calls = ControlCalls(timeout_s) if self.is_driver else None

    def sync(self, version: int) -> Path:
        from megatron_bapo.convert import save_model_as_hf

        target = self.root / f"v{version:06d}"
        save_model_as_hf(self.actor.model, self.hf_config, target, tokenizer_src=self.tokenizer_src,
                         max_shard_bytes=int(self.config.bucket_bytes), parallel=self.actor.parallel)
        if self.is_driver:
            body = {"model_path": str(target.absolute()), "weight_version": str(version), "flush_cache": True}
            self._calls.wait_all([self._calls.post(u, "/update_weights_from_disk", body) for u in self.urls],
                                 self.timeout_s)
            keep = int(getattr(self.config, "keep_versions", 2))
            versions = sorted(p for p in self.root.glob("v*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in versions[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info("weight sync v%s: %s loaded by %d server(s)", version, target, len(self.urls))
        return target

    def close(self) -> None:
        if self._calls is not None:
            self._calls.close()
            self._calls = None
