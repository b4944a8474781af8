"""A plain `python -m megatron_bapo.train` is a one-rank job whose rendezvous port is held from the
moment it is chosen: a port looked up free and bound later was taken in between by a parallel test
worker in CI, and the run died at start with EADDRINUSE."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, socket
    from megatron_bapo.models.parallel import ParallelConfig, init_distributed_env, initialize_model_parallel
    init_distributed_env()
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            print("port free")  # anyone could take it before the rendezvous binds it
        except OSError:
            print("port held")
    groups = initialize_model_parallel(ParallelConfig(backend="gloo"), seed=0)
    import torch.distributed as dist
    print("world", dist.get_world_size(), "dp", groups.dp_size)
""")


def test_a_one_rank_run_holds_its_rendezvous_port_until_it_uses_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["port held", "world 1 dp 1"], out.stdout
