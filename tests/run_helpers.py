"""Running `python -m megatron_bapo.train` as a user does, for the end-to-end tests: assets on disk
(data, a reward module loaded by import path), a small run config, the subprocess, and the
process checks (which processes a run left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Rewards with signal for a random model (half the responses score), and ones that fail. Loaded by
# import path, as users plug in their own rewards.
REWARD_MODULE = '''
def parity_reward(response: str, answer: str) -> float:
    return float(len(response) % 2 == 0)


def broken_reward(response: str, answer: str) -> float:
    raise KeyError("answer_format")


def char_sum_reward(response: str, answer: str) -> float:
    # A coin flip per response (its characters): some groups score all alike, most do not.
    return float(sum(map(ord, response)) % 2 == 0)
'''


def write_assets(root: Path) -> Path:
    """train.jsonl, test.jsonl and the reward module under `root` (which goes on PYTHONPATH)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a in range(10, 40) for b in range(10, 14)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    (root / "parity_reward_mod.py").write_text(REWARD_MODULE)
    return root


def run_config(assets, out: Path, *, sections: dict[str, dict[str, Any]] | None = None, **trainer) -> Path:
    """A 3-step run on the tiny model; `trainer` keys and whole-section `sections` updates override."""
    root, model = assets
    cfg = {
        "bapo_preset": "bapo",
        "model": {"hf_path": str(model)},
        "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "trainer": {"output_dir": str(out), "total_steps": 3, "save_every": 2, "progress": False, **trainer},
        "rollout": {"group_size": 4, "prompts_per_step": 3, "max_response_tokens": 6, "segment_tokens": 3,
                    "max_staleness": 2, "client": {"health_timeout_s": 180}},
        "reward": {"fn": "parity_reward_mod:parity_reward", "num_workers": 0},
        "actor": {"optim": {"lr": 1e-3}, "n_minibatches": 2, "max_tokens_per_microbatch": 256,
                  "vocab_divisible_by": 64},
        "eval": {"every_n_steps": 3, "datasets": [{"name": "t", "path": str(root / "test.jsonl")}], "n": 2,
                 "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "reward": "parity_reward_mod:parity_reward"},
    }
    for name, update in (sections or {}).items():
        cfg[name] = {**cfg.get(name, {}), **update}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_env(assets, **extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(assets[0]), str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def start_train(config: Path, assets, *extra: str, env: dict | None = None, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_bapo.train", "--config", str(config), *extra]
    return subprocess.Popen(cmd, env=env or train_env(assets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for a `start_train` process; its whole console output (killed if it outlives `timeout`)."""
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return log


def last_line(log: str) -> str:
    """The run's last console line (a run that stops says why there, in one line)."""
    return [ln for ln in log.splitlines() if ln.strip()][-1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def pids_running(config: Path) -> list[int]:
    """Live processes started with this config: the trainer and anything it forked (same command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(config) in cmdline and pid_alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def server_pids(out: Path) -> list[int]:
    path = out / "servers.json"
    return [s["pid"] for s in json.loads(path.read_text())] if path.exists() else []


def kill_the_server_then_finish(proc: subprocess.Popen, out: Path, ready: Callable[[], Any]) -> tuple[str, int]:
    """Once `ready()` returns, SIGKILL the run's one built-in server and let the run go on; returns
    (its whole console output, the killed pid). The trainer is never left running."""
    try:
        ready()
        [killed] = server_pids(out)
        os.kill(killed, signal.SIGKILL)
        return finish(proc), killed
    finally:
        if proc.poll() is None:
            proc.kill()


def finish_later(proc: subprocess.Popen, timeout: float = 600) -> Future:
    """`finish(proc, timeout)` on a thread, for a run started before the test that checks it (a run
    spends most of its time on one core: its imports, its server's start; two side by side take little
    longer than one). Its output is read as it comes, so a full pipe never stalls it; `.result()` is
    the whole console output, once the run has ended."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finish")
    try:
        return pool.submit(finish, proc, timeout)
    finally:
        pool.shutdown(wait=False)
