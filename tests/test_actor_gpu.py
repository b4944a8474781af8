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
    mcfg = actor.model[0].config
    assert mcfg.bias_activation_fusion and mcfg.bias_dropout_fusion  # models.builder.gpu_fusions
    assert mcfg.apply_rope_fusion == have_transformer_engine()
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


def _optimizer_snapshot(actor) -> dict:
    """DP=1: every fp32 main param and Adam moment (by position), and the steps wherever they live."""
    opt = actor.optimizer.chained_optimizers[0]
    inner = opt.optimizer
    tensors = [
        {k: v.detach().float().cpu().clone() for k, v in opt._get_main_param_and_optimizer_states(p).items()
         if isinstance(v, torch.Tensor) and v.dim() > 0}
        for p in opt.model_param_group_index_map
    ]
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}  # torch Adam: per parameter
    steps = steps or {float(g["step"]) for g in inner.param_groups if "step" in g}  # TE/Apex FusedAdam
    return {"tensors": tensors, "steps": sorted(steps)}


def test_distributed_optimizer_checkpoint_resumes_on_gpu(nccl_world, tmp_path):
    """The GPU side of tests/test_distributed_optimizer.py (TE FusedAdam keeps `step` in its param
    groups): the loaded state equals the saved one exactly and the continuation matches.
    Not run on a GPU yet (none in the session that wrote it); its body passes on CPU with torch AdamW."""
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.01), parallel=ParallelConfig(backend="nccl"),
                      max_tokens_per_microbatch=128)
    batches = [make_batch(num_seqs=8, max_len=48, seed=s) for s in range(4)]
    actor = Actor(cfg, TINY_QWEN2)
    assert actor.distributed_optimizer
    for b in batches[:2]:
        actor.train_step(b)
    actor.save_checkpoint(tmp_path / "ckpt")
    saved = _optimizer_snapshot(actor)
    for b in batches[2:]:
        actor.train_step(b)
    want = {n: p.detach().float().cpu().clone() for n, p in actor.model[0].named_parameters()}

    resumed = Actor(cfg, TINY_QWEN2)
    resumed.load_checkpoint(tmp_path / "ckpt")
    loaded = _optimizer_snapshot(resumed)
    assert saved["steps"] == loaded["steps"] == [2.0]
    for s, t in zip(saved["tensors"], loaded["tensors"]):
        assert s.keys() == t.keys()
        for k in s:
            torch.testing.assert_close(t[k], s[k], atol=0, rtol=0, msg=k)
    for b in batches[2:]:
        resumed.train_step(b)
    assert _optimizer_snapshot(resumed)["steps"] == [4.0]
    for n, p in resumed.model[0].named_parameters():  # GPU kernels may not be bitwise reproducible
        torch.testing.assert_close(p.detach().float().cpu(), want[n], atol=1e-5, rtol=0, msg=n)
