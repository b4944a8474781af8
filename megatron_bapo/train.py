"""Command line: `python -m megatron_bapo.train --config FILE [section.key=value ...]`.

Runs as one process on a laptop (a one-rank gloo job, built-in rollout servers) or under
`torchrun`/`srun` on a cluster (the same code; every rank runs this entry point).
"""

from __future__ import annotations

import argparse
import logging
import warnings
import os
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence

from megatron_bapo.config_io import ConfigError

if TYPE_CHECKING:
    from megatron_bapo.config import RunConfig
    from megatron_bapo.run_lock import RunLock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_bapo.train",
        description="BAPO reinforcement learning with a megatron-core actor and SGLang-compatible rollout servers.",
    )
    parser.add_argument("--config", help="run YAML (see examples/configs/)")
    parser.add_argument("--resume", dest="resume", action="store_true", default=None,
                        help="continue from the newest checkpoint in trainer.output_dir (the default)")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start from model.hf_path even if checkpoints exist")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50 actor.optim.lr=1e-6")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_bapo.config import dump_run_config, load_run_config

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"trainer.resume={'true' if args.resume else 'false'}")
    try:
        config = load_run_config(args.config, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_run_config(config), end="")
        return 0
    rank = int(os.environ.get("RANK", "0"))
    from megatron_bapo.run_lock import LockError, RunLock

    lock = None
    if rank == 0:  # before anything is written into trainer.output_dir (the log file is the first)
        try:
            lock = RunLock.acquire(config.trainer.output_dir)
        except LockError as exc:
            print(f"lock error: {exc}", file=sys.stderr)
            return 2
    try:
        return _train(config, args, rank, lock)
    finally:
        if lock is not None:
            lock.release()


def _train(config: "RunConfig", args: argparse.Namespace, rank: int, lock: Optional["RunLock"]) -> int:
    from megatron_bapo import logs

    # Rank 0: everything to <output_dir>/logs/train.log; the console gets warnings, the progress
    # bar and the compact lines of the `megatron_bapo.console` logger (megatron_bapo.logs).
    path = logs.configure(config.trainer.log_level, rank, config.trainer.output_dir)
    log = logging.getLogger("megatron_bapo.train")
    log.info("start: pid %d, --config %s (resolved: %s/config.yaml)", os.getpid(), args.config,
             config.trainer.output_dir)
    if lock is not None and lock.took_over:
        log.warning(lock.took_over)
    logging.getLogger(logs.CONSOLE).info("megatron_bapo: %d steps into %s (full log: %s)",
                                         config.trainer.total_steps, config.trainer.output_dir, path)
    if config.trainer.log_level.upper() != "DEBUG":
        # megatron-core logs every config dataclass and parameter-bucket list at INFO; keep its warnings.
        logging.getLogger("megatron.core").setLevel(logging.WARNING)
    # Expected on a CPU-only install (TE/Apex are GPU extras); not worth a screen of warnings per run.
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # megatron-core's checkpoint loader still uses torch's deprecated load_state_dict and
    # ShardedTensor: notices for megatron-core, printed on every resume, that a user cannot act on.
    # Same for its distributed optimizer: torch's deprecated collective names, and a `hasattr(param,
    # "grad")` on the optimizer's shard views (non-leaf tensors) in zero_grad.
    for message in ("`load_state_dict` is deprecated", "Please use DTensor instead",
                    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning)
    from megatron_bapo.actor.errors import SkippedStepsError
    from megatron_bapo.driver_process import DriverProcessError
    from megatron_bapo.experience import RewardFailure
    from megatron_bapo.progress import NoProgressError
    from megatron_bapo.rewards import RewardSpecError
    from megatron_bapo.rollout.errors import RolloutError
    from megatron_bapo.run_state import CheckpointError
    from megatron_bapo.sync.export import ExportWriteError
    from megatron_bapo.trainer import Terminated, Trainer

    # Errors that name their fix are one line (the traceback in the log file at DEBUG); anything else
    # is a bug and keeps its traceback.
    kinds = {ConfigError: "config error", RewardSpecError: "config error", CheckpointError: "checkpoint error",
             RewardFailure: "reward error", RolloutError: "rollout error", NoProgressError: "progress error",
             SkippedStepsError: "training error", ExportWriteError: "sync error",
             DriverProcessError: "driver error"}
    started = time.monotonic()
    try:
        history = Trainer(config).run()
    except Terminated as exc:  # SIGTERM: one line, the conventional exit code 143
        if rank == 0:
            log.info(exc.message)
            print(exc.message, file=sys.stderr)
        return int(exc.code)
    except tuple(kinds) as exc:
        if rank == 0:
            kind = next(v for k, v in kinds.items() if isinstance(exc, k))
            # The file gets the line (and the traceback at DEBUG); the console the line alone.
            log.info("stopped: %s: %s", kind, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            print(f"{kind}: {exc}", file=sys.stderr)
        return 2
    except Exception:
        # A bug: Python prints the traceback on the console; INFO puts it in the log file only.
        log.info("stopped by an unexpected error", exc_info=True)
        raise
    if rank == 0 and history:
        first, last = history[0], history[-1]
        # One step's reward is noisy (16 prompts): compare the means of the first and last 10 steps.
        rewards = [h["rollout/reward_mean"] for h in history if "rollout/reward_mean" in h]
        n = min(10, len(rewards) // 2)
        reward = (f", reward (mean of {n} steps) {sum(rewards[:n]) / n:.3f} -> {sum(rewards[-n:]) / n:.3f}"
                  if n else "")
        updated = sum(1 for h in history if h.get("train/updated"))
        logging.getLogger(logs.CONSOLE).info("done: steps %d-%d in %.0f s, %d of %d steps updated the policy%s",
                                             first["step"], last["step"], time.monotonic() - started, updated,
                                             len(history), reward)
    return 0


if __name__ == "__main__":
    from megatron_bapo.process_exit import exit_now

    exit_now(main())
