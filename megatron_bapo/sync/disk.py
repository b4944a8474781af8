"""Weight sync through a shared file system: HF safetensors + `/update_weights_from_disk`.

All actor ranks gather the weights (`convert.save_model_as_hf`; the writer renames a complete
`vNNNNNN.tmp` directory into place, so a server never reads a partial one); rank 0 then makes
every server load it through the rollout client (under `sync.pause_mode`, see sync.pause). Older
version directories beyond `keep_versions` are deleted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional

from megatron_bapo.sync.pause import paused

logger = logging.getLogger(__name__)


class DiskWeightSync:
    """`sync(version)` writes `root/v{version:06d}` and makes every server load it.

    Construct on every actor rank; `client` (the rollout client) on global rank 0 only.
    """

    def __init__(self, config: Any, actor: Any, hf_config: Any, root: str | Path, client: Any = None, *,
                 tokenizer_src: Optional[str | Path] = None) -> None:
        self.config = config
        self.actor = actor
        self.hf_config = hf_config
        self.root = Path(root)
        self.client = client
        self.tokenizer_src = tokenizer_src
        self.is_driver = actor.parallel.rank == 0
        if self.is_driver and client is None:
            raise ValueError("DiskWeightSync: rank 0 needs the rollout client (the servers to update)")

    def sync(self, version: int) -> Path:
        from megatron_bapo.convert import save_model_as_hf

        target = self.root / f"v{version:06d}"
        save_model_as_hf(self.actor.model, self.hf_config, target, tokenizer_src=self.tokenizer_src,
                         max_shard_bytes=int(self.config.bucket_bytes), parallel=self.actor.parallel)
        if self.is_driver:
            self.publish(version)
            keep = int(getattr(self.config, "keep_versions", 2))
            versions = sorted(p for p in self.root.glob("v*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in versions[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def publish(self, version: int) -> None:
        """Rank 0: make every server load the written `version` (again, after a server restart)."""
        target = self.root / f"v{version:06d}"
        with paused(self.client, self.config.pause_mode):
            self.client.update_weights_from_disk(str(target.absolute()), version)
        logger.info("weight sync v%s: %s loaded", version, target)

    def close(self) -> None:
        """Nothing to release (the client belongs to the caller)."""
