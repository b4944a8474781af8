"""The server pool's weight checks (`sync.verify`): after an update and after a restart, what a failing
server costs. A mixin of `rollout.pool.ServerPool` (its servers, restarts and served version), as
`rollout.control` is of the client; the checks themselves are `sync.verify.Verifier`'s."""

from __future__ import annotations

import logging
from typing import Any

from megatron_bapo.sync.verify import ResendWeights, WeightCheckError

logger = logging.getLogger("megatron_bapo.rollout.pool")  # the pool's lines, one logger


class WeightChecks:
    """Needs `verifier`, `client`, `servers`, `served`, `sync`, `kind`, `version`, `_check_restarts`,
    `_restart(i, why, why_again)` and `_give_current_version(urls, updating=...)`."""

    verifier: Any
    client: Any
    servers: list
    served: Any

    def verify_servers(self) -> None:
        """Check every server against the served version now (`sync.verify`; what an update and a restart do)."""
        self._verify(self.client.worker_urls(), self.version)

    def _verify(self, urls: list[str], version: int) -> None:
        """`sync.verify`'s check of `urls` against `version`: a failing server is restarted once with the
        current weights (disk: the version's directory; distributed: `ResendWeights`, the trainer sends
        the version again) and checked again; a second failure raises WeightCheckError."""
        failures = self.verifier.check(self.client, urls)
        if not failures:
            if self.verifier.current is not None:
                logger.info("weight check v%d (sync.verify=%s) passed on %d server(s): %s", version,
                            self.sync.verify, len(urls), self.verifier.summary)
            return
        own = {s.url: i for i, s in enumerate(self.servers)}
        again = {u: why for u, why in failures.items() if self._check_restarts.get(u) == version}
        if again:
            url, why = next(iter(again.items()))
            what = (f"{self.kind} {url} does not serve weight version {version} after a restart with it: {why}; its "
                    f"log: {self.servers[own[url]].log_path}") if url in own else \
                f"server {url} does not serve weight version {version} after it was sent the version again: {why}"
            raise WeightCheckError(what)
        for url, why in failures.items():
            self._check_restarts[url] = version
            code = self._exit_code_of(url)
            if code is not None:  # a crash the check found first: restarted and counted as any dead server is
                self._restart(own[url], f"died with exit code {code}", f"died again (exit code {code})")
                continue
            logger.warning("server %s failed the weight check of version %d: %s", url, version, why)
            if url in own:
                self._restart(own[url], f"failed the weight check of version {version}",
                              f"failed the weight check of version {version} ({why})")
        urls = list(failures)
        if self.served.path is None:  # distributed: the restarted servers hold no copy of this version
            raise ResendWeights(f"server(s) {', '.join(urls)} restarted after failing the weight check of "
                                f"version {version}: it is sent again")
        restarted = [u for u in urls if u in own]
        self._give_current_version(restarted, updating=False)
        external = [u for u in urls if u not in own]  # not ours to restart: the version is loaded again
        if external:
            self.client.update_weights_from_disk(self.served.path, version, only=external)
        self.client.wait_healthy()
        self._verify(urls, version)
