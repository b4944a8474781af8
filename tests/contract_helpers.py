"""One live server per engine for the contract tests: the built-in server and the real SGLang.

`Served` has the run's own `ServerPool` start one server of either engine on loopback
(`rollout.engine`: the built-in server, or SGLang's `sglang.launch_server` on CPU from
`.venv-sglang`), with an API key and the flags the sync config asks for, exactly as a training run
starts them; it remembers what the server serves (weights and version) and computes what it should
answer: log-probs of a transformers forward of those weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
ENGINES = ("builtin", "sglang")
API_KEY = "contract-key"
PROMPT = [10, 43, 12, 51, 30, 61]
LONG = 400
"""New tokens of a request that must still be running when a pause, an abort or a flush arrives
(with ignore_eos; the tiny model's context is 512)."""
MAX_TOTAL_TOKENS = 8192
"""`rollout.sglang.max_total_tokens` of the SGLang servers (checked in their `/server_info`)."""


class Served:
    """A live server of `engine`, started by a `ServerPool`, serving `model_a` as version 0."""

    def __init__(self, engine: str, model_a: Path, model_b: Path, log_dir: Path, *,
                 pause_mode: Optional[str] = None, seed: int = 0) -> None:
        from megatron_bapo.config import RolloutConfig
        from megatron_bapo.rollout.config import RolloutClientConfig
        from megatron_bapo.rollout.pool import ServerPool
        from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig
        from megatron_bapo.sync.config import SyncConfig

        if engine == "sglang" and not SGLANG_PYTHON.exists():
            pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
        self.engine, self.model_a, self.model_b, self.log_dir = engine, Path(model_a), Path(model_b), Path(log_dir)
        self.rollout = RolloutConfig(
            engine=engine, client=RolloutClientConfig(api_key=API_KEY, health_timeout_s=300, max_retries=2,
                                                      backoff_s=0.2, flush_cache_timeout_s=30),
            sglang=SGLangLaunchConfig(device="cpu", max_total_tokens=MAX_TOTAL_TOKENS))
        self.sync = SyncConfig(method="disk", pause_mode=pause_mode)
        self.pool = ServerPool(self.rollout, self.sync, model_path=str(self.model_a), seed=seed, log_dir=self.log_dir,
                               state_path=self.log_dir / "servers.json")
        self._refs: dict[Path, Any] = {}
        try:
            self.client = self.pool.start()
        except BaseException:
            self.pool.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self.pool.servers[0].url

    @property
    def version(self) -> int:
        return self.pool.version

    @property
    def weights(self) -> Path:
        """What the server serves: the served version's directory, `model_a` at version 0."""
        return Path(self.pool.served.path) if self.pool.served.path else self.model_a

    def close(self) -> None:
        self.pool.close()

    def kill(self) -> None:
        """SIGKILL the server's process, as a crash would, and wait until it is gone."""
        server = self.pool.servers[0]
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait(timeout=60)

    # ------------------------------------------------------------------ weights
    def load(self, path: Path, *, pause_mode: Optional[str] = None, probe: Any = None) -> int:
        """The pool's update of every server to the next version, from `path` on disk, under
        `pause_mode` (None: this Served's sync config), as the trainer's disk sync does; returns it.
        `probe`: the trainer's probe of `path`'s weights (`Served.probe`, `sync.verify=probe`)."""
        version = self.version + 1
        self.pool.sync = dataclasses.replace(self.sync, pause_mode=pause_mode or self.sync.pause_mode)
        try:
            with self.pool.update(version, probe) as session:
                session.load_from_disk(Path(path), version)
        finally:
            self.pool.sync = self.sync
        assert self.version == version
        return version

    def verify_with(self, mode: str) -> None:
        """The pool checks its servers with `sync.verify=mode` from now on, as a run so configured does
        (its `/server_info` read as before the first update)."""
        from megatron_bapo.sync.verify import Verifier

        self.sync = dataclasses.replace(self.sync, verify=mode)
        self.pool.sync = self.sync
        self.pool.verifier = Verifier(self.sync, str(self.model_a))
        self.pool.verifier.set_servers(self.client.run(self.client.aget_server_info()))

    def probe(self, path: Path, num_tokens: int = 32) -> Any:
        """The trainer's side of `sync.verify=probe` for the weights at `path`: their fp32 log-probs of
        the probe sequence (a transformers forward stands in for the actor's)."""
        from megatron_bapo.sync.verify import Probe, probe_token_ids

        ids = probe_token_ids(self.reference(path).config.vocab_size, num_tokens)
        return Probe(tuple(ids), tuple(self.ref_logprobs(ids[:1], ids[1:], path=path).tolist()), "float32")

    def reference(self, path: Optional[Path] = None) -> Any:
        """A transformers model of `path` (default: what is served), fp32, eval mode."""
        from transformers import AutoModelForCausalLM

        path = Path(path or self.weights)
        if path not in self._refs:
            self._refs[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return self._refs[path]

    def ref_logprobs(self, prompt: Sequence[int], output: Sequence[int], *, path: Optional[Path] = None,
                     temperature: float = 1.0) -> torch.Tensor:
        """log p(output[i] | prompt + output[:i]) under `path`'s weights at `temperature` (float64)."""
        ids = torch.tensor([list(prompt) + list(output)])
        with torch.no_grad():
            logits = self.reference(path)(ids).logits[0, len(prompt) - 1:-1].double()
        logp = torch.log_softmax(logits / temperature, -1)
        return logp.gather(-1, torch.tensor(list(output))[:, None])[:, 0]

    # ------------------------------------------------------------------ raw HTTP and load
    def http(self, method: str, path: str, body: Optional[dict] = None, *, key: Optional[str] = API_KEY,
             timeout: float = 60) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def num_running(self) -> int:
        status, text = self.http("GET", "/v1/loads?include=core")
        assert status == 200, text
        return sum(int(entry.get("num_running_reqs", 0)) for entry in json.loads(text)["loads"])

    def long_requests(self, num: int, *, max_new_tokens: int = LONG,
                      temperature: float = 1.0) -> list[tuple[list[int], Future]]:
        """`num` (prompt, future) requests that keep generating (ignore_eos) until something stops
        them; returns once the server runs all of them and has decoded a few steps with them in the
        batch (a short request admitted after them finished)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
        prompts = [PROMPT[:3] + [i + 1] + PROMPT[3:] for i in range(num)]
        futures = [self.client.submit(self.client.agenerate(p, params)) for p in prompts]
        deadline = time.monotonic() + 60
        while self.num_running() < num:
            assert time.monotonic() < deadline, "the long requests never ran"
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            time.sleep(0.02)
        self.client.generate(PROMPT, {"max_new_tokens": 2, "temperature": 1.0})
        assert not any(f.done() for f in futures), "a long request finished before the test could stop it"
        return list(zip(prompts, futures))


def check_logprobs(served: Served, prompt: Sequence[int], result: Any, *, path: Optional[Path] = None,
                   temperature: float = 1.0, atol: float = 1e-4) -> None:
    """The reply's log-probs are `path`'s (default: the served weights') for its own tokens."""
    assert len(result.output_ids) == len(result.logprobs) == len(result.versions)
    if not result.output_ids:
        return
    ref = served.ref_logprobs(prompt, result.output_ids, path=path, temperature=temperature)
    torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), ref, atol=atol, rtol=0)
