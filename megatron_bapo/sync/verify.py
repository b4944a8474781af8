"""Served weights verified after every sync and every server restart (`sync.verify`).

Why: nothing else checks that the servers hold the weights the trainer sent. A wrong Megatron -> HF
conversion loads without an error and serves another function; a server restarted on the checkpoint's
weights reports the current version; either way the trainer learns from samples of another policy.

Two checks, both run by rank 0's server pool (`rollout.pool.ServerPool`) after an update and after a
restart, while rollout requests wait in the client (none reaches a server before the check passed):

- "probe": every actor rank computes the actor's log-probs of one fixed sequence (`actor_probe`: one
  forward, collective; pseudo-random ids from a fixed seed, `sync.probe_tokens` long, the same every
  sync) and rank 0 hands them to the update; every server scores the sequence in one prefill
  (`/generate` with `max_new_tokens` 0 and `logprob_start_len` 0). A server fails when the probe KL
  (`probe_kl`: mean over the tokens of exp(d) - 1 - d, d = actor - server log-prob) is above
  `sync.probe_max_kl` (null: `PROBE_MAX_KL` by dtype) or not finite. Any engine; it sees what the weights compute, so a wrong
  conversion fails too. Under the "retract" / "in_place" pauses the servers continue the requests
  they hold while the probe runs (one prefill); the other modes run nothing but the probe.
- "checksum": the hashes of what was sent, in each server's own layout and with its own hash
  (`convert.served_layout`: disk: the version's files; distributed: each bucket as it goes out),
  against every server's `/weights_checker` hashes, tensor by tensor, before the servers continue.
  Exact. It checks delivery (a stale, partial or corrupted copy), not the conversion: a wrong
  conversion is hashed on both sides alike.

What a failure does (`ServerPool`): the server is restarted once with the current weights (the crash
path; disk: the version's directory, distributed: `ResendWeights` and the trainer sends the version
again) and checked again before it takes requests; a second failure stops the run with one line
naming the server, the KL or the tensor, and the version (`WeightCheckError`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.sync.config import SyncConfig

logger = logging.getLogger(__name__)
PROBE_SEED = 42_0042
"""Seed of the probe's token ids (fixed: every sync and every restart scores the same sequence)."""
PROBE_MAX_KL = {"float32": 1e-10, "16-bit": 1e-2}
"""The probe KL a server may show when `sync.probe_max_kl` is null: "float32" when the actor and the
server both compute in float32, else "16-bit". Measured on the tiny model (benchmarks/bench_verify.py,
docs/cluster.md): the same weights 4e-14 in float32 and 3e-7 with a bfloat16 server (real models in
bfloat16: ~1e-3); the weights one Adam step (lr 1e-4) old 3e-6; one corrupted tensor 2e-8 (1% noise) to
2e-4 (zeroed)."""
_LOG_RATIO_LIMIT = 20.0  # as the loss clamps log-ratios: exp(20) is finite, a wild probe stays a number


class WeightCheckError(RolloutError):
    """A server failed the weight check again after a restart with the current weights: the run stops."""


class ResendWeights(Exception):
    """A server failed the weight check under the distributed sync and was restarted: the restarted
    server holds no weights of this version, so every rank exports it again (`Trainer.sync_weights`)."""


@dataclass(frozen=True)
class Probe:
    """The actor's log-probs of the probe sequence: `logprobs[t - 1]` = log p(ids[t] | ids[:t])."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    dtype: str = "float32"
    """What the actor computes in (its parameters' dtype): with a float32 server it picks the threshold."""


def probe_token_ids(vocab_size: int, num_tokens: int) -> list[int]:
    """The probe sequence: `num_tokens` ids in [0, vocab_size) from `PROBE_SEED`."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return [int(i) for i in torch.randint(0, int(vocab_size), (int(num_tokens),), generator=g)]


def actor_probe(actor: Any, vocab_size: int, num_tokens: int) -> Probe:
    """The actor's log-probs of the probe sequence at temperature 1: one forward-only pass
    (`Actor.compute_logprobs`), collective over every rank, identical result on every rank."""
    ids = probe_token_ids(vocab_size, num_tokens)
    t = torch.tensor([ids])
    lp = actor.compute_logprobs({"input_ids": t, "attention_mask": torch.ones_like(t)})
    dtype = str(next(actor.model[0].parameters()).dtype).replace("torch.", "")
    return Probe(tuple(ids), tuple(float(x) for x in lp[0, 1:].tolist()), dtype)


def probe_kl(reference: Iterable[float], served: Iterable[float]) -> float:
    """Mean over the probe's tokens of exp(d) - 1 - d, d = reference - served (clamped to +-20): 0 for
    equal log-probs, ~d^2 / 2 for small d (the k3 statistic of `mismatch/kl_k3`, on a fixed sequence);
    inf when the lengths differ or a value is not finite."""
    ref = torch.tensor(list(reference), dtype=torch.float64)
    out = torch.tensor(list(served), dtype=torch.float64)
    if ref.shape != out.shape or not ref.numel() or not bool(torch.isfinite(out).all()):
        return math.inf
    d = (ref - out).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return float((d.exp() - 1.0 - d).mean())


class ExpectedChecksums:
    """The `/weights_checker` hashes a server of one layout (dtype, device type) must report for the
    tensors `add`ed (HF names, any order, any bucketing)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device_type: str) -> None:
        from megatron_bapo.convert.served_layout import ServedLayout

        self.layout = ServedLayout(hf_config, dtype)
        self.device_type = device_type
        self.checksums: dict[str, str] = {}
        self.num_bytes = 0
        """Bytes hashed (the server layout's, padding included)."""

    def add(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        from megatron_bapo.convert.served_layout import tensor_hash

        served = [pair for name, t in named for pair in self.layout.add(name, t)]
        self.num_bytes += sum(t.numel() * t.element_size() for _, t in served)
        if self.device_type == "cpu" and len(served) > 1:  # sha256 releases the GIL: one tensor per thread
            with concurrent.futures.ThreadPoolExecutor(min(len(served), os.cpu_count() or 1)) as pool:
                hashes = list(pool.map(lambda t: tensor_hash(t, "cpu"), [t for _, t in served]))
        else:
            hashes = [tensor_hash(t, self.device_type) for _, t in served]
        self.checksums.update((name, h) for (name, _), h in zip(served, hashes))

    @classmethod
    def of_directory(cls, path: Path, hf_config: Any, dtype: torch.dtype, device_type: str) -> "ExpectedChecksums":
        """The hashes of an HF checkpoint directory (what `/update_weights_from_disk` loads)."""
        from megatron_bapo.convert.hf_io import HFCheckpointReader

        out = cls(hf_config, dtype, device_type)
        with HFCheckpointReader(path) as reader:
            for name in reader.names():
                out.add([(name, reader.get(name))])
        return out


def server_layout(url: str, info: dict, hf_config: dict) -> tuple[torch.dtype, str]:
    """(dtype, device type) of a server from its `/server_info`, or ConfigError naming what the
    checksum does not cover (a server at TP > 1, a family without a server layout)."""
    from megatron_bapo.convert.served_layout import SERVED_FAMILIES, served_dtype

    arch = (hf_config.get("architectures") or [None])[0]
    tp = int(info.get("tp_size", 1) or 1)
    if arch not in SERVED_FAMILIES or tp != 1:
        what = (f"a {arch} model" if arch else "a model without an HF config.json") if arch not in SERVED_FAMILIES \
            else f"a server at TP {tp} ({url})"
        raise ConfigError(f"sync.verify=checksum cannot check {what}: its server layout is implemented for "
                          f"{', '.join(SERVED_FAMILIES)} served at TP 1; use sync.verify=probe")
    device = str(info.get("device") or "cpu")
    return served_dtype(str(info.get("dtype") or "auto"), hf_config), ("cuda" if device.startswith("cuda") else device)


class Verifier:
    """Rank 0's expectation of what every server serves, and the check of one server against it."""

    def __init__(self, config: SyncConfig, model_path: str) -> None:
        self.mode = config.verify
        self.max_kl = config.probe_max_kl
        self.model_path = model_path
        self.layouts: dict[str, tuple[torch.dtype, str]] = {}
        """Each server's (dtype, device type), from `/server_info` before the first update."""
        self.summary = ""
        """What the last check saw (the pool logs it): the largest probe KL, or the tensors and bytes compared."""
        self.current: Optional[dict] = None
        """What the served version must show: {"probe": Probe} or {"path": dir} / {"sums": {layout: ...}}."""
        self._next: Optional[dict] = None

    def hf_config(self) -> dict:
        """The served model's HF config (`model.hf_path`; {} without one: "auto" dtypes then resolve as
        for a float32 checkpoint, and the checksum refuses an unknown family)."""
        path = Path(self.model_path) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def set_servers(self, infos: dict[str, dict]) -> None:
        """Every server's dtype (the probe's threshold) and, for checksums, its layout (refused: ConfigError)."""
        from megatron_bapo.convert.served_layout import served_dtype

        if self.mode == "checksum":
            config = self.hf_config()
            self.layouts = {url: server_layout(url, info, config) for url, info in infos.items()}
        elif self.mode == "probe":
            config = self.hf_config()
            self.layouts = {url: (served_dtype(str(info.get("dtype") or "auto"), config), "") for url, info in infos.items()}

    def max_kl_of(self, url: str, probe: Probe) -> float:
        """`sync.probe_max_kl`, or by dtype (`PROBE_MAX_KL`) when it is null."""
        if self.max_kl is not None:
            return float(self.max_kl)
        fp32 = probe.dtype == "float32" and self.layouts.get(url, (torch.float32,))[0] == torch.float32
        return PROBE_MAX_KL["float32" if fp32 else "16-bit"]

    # ------------------------------------------------------------------ one update
    def begin(self, probe: Optional[Probe]) -> bool:
        """A new version is being delivered; whether it will be checked (probe mode needs the actor's
        probe, which `Trainer.sync_weights` hands over; an update without one is not checked)."""
        if self.mode == "probe":
            self._next = {"probe": probe} if probe is not None else None
        elif self.mode == "checksum":
            config = self.hf_config()
            self._next = {"sums": {layout: ExpectedChecksums(config, *layout) for layout in set(self.layouts.values())}}
        else:
            self._next = None
        return self._next is not None

    def sent(self, bucket: list) -> None:
        """A bucket of (HF name, tensor) went out (distributed): hashed while its tensors are valid."""
        if self._next is not None and "sums" in self._next:
            for expected in self._next["sums"].values():
                expected.add(bucket)

    def loaded(self, path: Path) -> None:
        """The servers loaded the HF directory `path` (disk): the expectation is its files."""
        if self._next is not None and "sums" in self._next:
            self._next = {"path": Path(path), "sums": {}}

    def delivered(self) -> None:
        """The update reached every server: its expectation (None: unchecked) is the current one,
        which restarts are checked against until the next update."""
        self.current, self._next = self._next, None

    # ------------------------------------------------------------------ the check
    def check(self, client: Any, urls: list[str]) -> dict[str, str]:
        """{url: why} for every server in `urls` that does not serve the current version's weights."""
        if self.current is None:
            return {}
        if "probe" in self.current:
            probe: Probe = self.current["probe"]
            replies = client.run(_gather({u: client.ascore(u, list(probe.token_ids)) for u in urls}))
            kls = [probe_kl(probe.logprobs, r) for r in replies.values() if not isinstance(r, BaseException)]
            self.summary = f"probe KL max {max(kls, default=math.nan):.3g} over {len(probe.logprobs)} tokens"
            return {u: why for u, r in replies.items() if (why := self._probe_failure(u, probe, r))}
        replies = client.run(_gather({u: client.aweights_checksum(u) for u in urls}))
        failures = {u: why for u, r in replies.items() if (why := self._checksum_failure(u, r))}
        sums = self.current["sums"].values()
        self.summary = (f"{max((len(e.checksums) for e in sums), default=0)} tensors compared, "
                        f"{sum(e.num_bytes for e in sums) / 1e6:.1f} MB hashed by the trainer")
        return failures

    def _probe_failure(self, url: str, probe: Probe, reply: Any) -> Optional[str]:
        if isinstance(reply, BaseException):
            return f"the probe failed: {reply}"
        kl, limit = probe_kl(probe.logprobs, reply), self.max_kl_of(url, probe)
        if kl <= limit:
            return None
        return f"probe KL {kl:.3g} over {len(probe.logprobs)} tokens > {limit:g} (sync.probe_max_kl)"

    def _expected(self, layout: tuple[torch.dtype, str]) -> dict[str, str]:
        sums = self.current["sums"]
        if layout not in sums:  # disk: hashed from the version's files once per layout
            sums[layout] = ExpectedChecksums.of_directory(self.current["path"], self.hf_config(), *layout)
        return sums[layout].checksums

    def _checksum_failure(self, url: str, reply: Any) -> Optional[str]:
        if isinstance(reply, BaseException):
            return f"/weights_checker failed: {reply}"
        expected = self._expected(self.layouts[url])
        ranks = reply.get("ranks") or []
        if len(ranks) != 1:
            return f"/weights_checker reported {len(ranks)} engine ranks (expected 1)"
        served = ranks[0].get("checksums") or {}
        differ = [n for n in expected if served.get(n) != expected[n]]
        extra = sorted(set(served) - set(expected))
        if not differ and not extra:
            return None
        if differ:
            name = differ[0]
            state = "is missing" if name not in served else f"differs ({served[name]} != {expected[name]})"
            return f"tensor {name} {state}; {len(differ)} of {len(expected)} tensors differ (sync.verify=checksum)"
        return f"tensor {extra[0]} is served but was not sent; {len(extra)} such (sync.verify=checksum)"


async def _gather(calls: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    return dict(zip(calls, results))
