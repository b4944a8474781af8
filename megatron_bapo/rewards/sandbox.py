"""Plugin rewards ("package.module:function") run in worker processes with a timeout.

A plugin is user code: it may raise, return NaN, or hang (a lock, a network call, a runaway
computation). In the trainer every plugin call goes to a `rewards.workers` subprocess that imports
the plugin once; a call still running after `timeout_s` is killed with its worker and scores 0 as
"timeout"; an exception scores 0 as "error" with its text kept (`RewardResult.error`), so the
driver can stop a run whose reward keeps failing and say why.

    python -m megatron_bapo.rewards.sandbox SPEC     (the worker; started by `SandboxedReward`)
"""

from __future__ import annotations

import dataclasses
import sys
from math import isfinite

from megatron_bapo.rewards import workers
from megatron_bapo.rewards.types import RewardResult


@dataclasses.dataclass(frozen=True)
class SandboxedReward:
    """A `DetailedRewardFn` calling plugin `spec` in worker processes, each call bounded by `timeout_s`."""

    spec: str
    timeout_s: float = 60.0
    num_workers: int = 2

    def __call__(self, response: str, answer: str) -> RewardResult:
        pool = workers.worker_pool(("-m", "megatron_bapo.rewards.sandbox", self.spec), self.num_workers,
                                   f"reward {self.spec}")
        reply, status = pool.call({"response": response, "answer": answer}, self.timeout_s)
        if status == "timeout":
            return RewardResult(0.0, "timeout", None, failed=True,
                                error=f"reward {self.spec} still running after {self.timeout_s:g} s (reward.timeout_s)")
        if status != "ok":
            return RewardResult(0.0, "error", None, failed=True, error=f"reward {self.spec}: its worker process died")
        return RewardResult(**reply)


def _call(fn, request: dict) -> dict:
    try:
        value = fn(request["response"], request["answer"])
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, never fatal here
        return dataclasses.asdict(RewardResult(0.0, "error", None, failed=True, error=f"{type(exc).__name__}: {exc}"[:500]))
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not isfinite(value):
        return dataclasses.asdict(RewardResult(0.0, "invalid_reward", None, failed=True,
                                               error=f"returned {value!r}, not a finite number"[:500]))
    return dataclasses.asdict(RewardResult(float(value), "scored"))


def worker_main(spec: str) -> None:
    from megatron_bapo.rewards import load_reward_fn

    out = workers.reply_channel()  # before the import: a plugin printing at import cannot break the replies
    fn = load_reward_fn(spec)
    workers.serve(lambda req: _call(fn, req), out)


if __name__ == "__main__":
    worker_main(sys.argv[1])
