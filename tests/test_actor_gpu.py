"""GPU paths: Transformer Engine layer spec and NCCL, one process on one GPU (skipped without CUDA).

Prints step time and peak GPU memory (run with -s to see them).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from test_actor_helpers import TINY_QWEN2, make_batch  # noqa: E402


@pytest.fixture
def nccl_world():
    from test_actor_helpers import TINY_QWEN2  # noqa: F401
    from dist_harness import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_actor_on_gpu_with_nccl_and_te(nccl_world, dtype):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.layer_spec import have_transformer_engine
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), parallel=ParallelConfig(backend="nccl"), dtype=dtype,
                      max_tokens_per_microbatch=128)
    actor = Actor(cfg, TINY_QWEN2)
    assert torch.distributed.get_backend() == "nccl"
    assert actor.distributed_optimizer
    core = type(actor.model[0].module.decoder.layers[0].self_attention.core_attention).__name__
    assert ("TE" in core) == have_transformer_engine()
    b = make_batch(num_seqs=16, max_len=48)
    before = actor.compute_logprobs(b)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = actor.train_step(b)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    after = actor.compute_logprobs(b)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if not k.startswith("bapo/rho"))
    assert (after - before).abs().max() > 0
    print(f"\n[gpu] dtype={dtype} core_attention={core} step={step_s * 1000:.1f} ms "
          f"peak_mem={torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
