"""The CPU compatibility layer: what it redirects, that it is idempotent, and that it is complete.

The completeness test records every `torch.cuda.*` function called while the actor trains with
TP/PP/DP and checkpoints; a megatron-core path that starts to need a new CUDA call fails here
(and, without CUDA, would raise anyway instead of silently running elsewhere).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are inactive when CUDA is present")

from megatron_bapo.models import cpu_compat  # noqa: E402

# The torch.cuda functions the stack may call on CPU: shimmed ones, and queries/lazy calls that
# are safe without CUDA.
ALLOWED_CUDA_CALLS = {
    "is_available", "current_device", "synchronize", "manual_seed", "manual_seed_all",
    "device_count", "is_initialized", "_lazy_call", "is_bf16_supported", "_is_compiled", "_is_in_bad_fork",
}


def test_install_is_idempotent_and_active():
    assert cpu_compat.install() is True
    assert cpu_compat.install() is True
    assert cpu_compat.is_installed()
    # Two active modes would rewrite the name twice ("torch.cuda.cuda.FloatTensor").
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64


def test_cuda_placement_is_redirected_to_cpu():
    cpu_compat.install()
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(3, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).to("cuda", torch.float64).dtype == torch.float64
    assert not torch.empty(2, pin_memory=True).is_pinned()


def test_unshimmed_cuda_calls_still_fail_loudly():
    cpu_compat.install()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.get_rng_state()


def _tracker_streams(rank, world_size):
    from megatron.core import tensor_parallel
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(before, torch.get_rng_state())  # default stream untouched
    with tracker.fork():
        b = torch.rand(4)
    return type(tracker).__name__, a, b


def test_rng_tracker_gives_per_tp_rank_streams(run_dist):
    (name, a0, b0), (_, a1, b1) = run_dist(_tracker_streams, 2, timeout=60)
    assert name == "CpuRNGStatesTracker"
    assert not torch.equal(a0, b0)  # the forked stream advances
    assert not torch.equal(a0, a1)  # TP ranks draw different streams (seed + tp_rank)


def _record_cuda_calls(rank, world_size, ckpt):
    import functools

    called = set()
    for name in dir(torch.cuda):
        fn = getattr(torch.cuda, name)
        if callable(fn) and not isinstance(fn, type) and not name.startswith("__"):
            def wrap(f, n=name):
                @functools.wraps(f)
                def inner(*a, **k):
                    called.add(n)
                    return f(*a, **k)
                return inner
            setattr(torch.cuda, name, wrap(fn))

    from test_actor_helpers import TINY_QWEN2, make_batch

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), parallel=ParallelConfig(tp=2, pp=2), max_tokens_per_microbatch=40)
    actor = Actor(cfg, TINY_QWEN2)
    actor.train_step(make_batch())
    actor.save_checkpoint(ckpt)
    actor.load_checkpoint(ckpt)
    return called


def test_actor_paths_hit_no_new_cuda_call(run_dist, tmp_path):
    """TP=2 x PP=2 train step (1F1B, optimizer, grad clipping) + checkpoint save/load on 4 ranks."""
    for called in run_dist(_record_cuda_calls, 4, str(tmp_path / "ck"), timeout=180):
        assert called <= ALLOWED_CUDA_CALLS, f"new CUDA calls on the CPU path: {sorted(called - ALLOWED_CUDA_CALLS)}"
        assert "current_device" in called  # the recorder works


def _sp_collectives(rank, world_size):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings

    # No collective shim: megatron's module-level names are still torch's own functions.
    names = {
        mod.__name__.rsplit(".", 1)[1] + "." + n: getattr(mod, n) is getattr(dist, want)
        for mod in (layers, mappings)
        for n, want in (("dist_all_gather_func", "all_gather_into_tensor"),
                        ("dist_reduce_scatter_func", "reduce_scatter_tensor"))
    }
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for async_op in (False, True):  # layers.py backward uses async_op=True and waits on the handle
            x = (torch.arange(4.0) + 10 * rank).to(dtype)
            gathered, scattered = torch.empty(8, dtype=dtype), torch.empty(2, dtype=dtype)
            works = [dist.all_gather_into_tensor(gathered, x, group=group, async_op=async_op),
                     dist.reduce_scatter_tensor(scattered, x, group=group, async_op=async_op)]
            for w in works:
                if async_op:
                    w.wait()
            out[(str(dtype), async_op)] = (gathered.float(), scattered.float())
    return names, out


def test_gloo_has_the_collectives_sequence_parallelism_uses(run_dist):
    """SP's raw collectives (all_gather_into_tensor, reduce_scatter_tensor; sync and async, fp32 and bf16)
    are native in gloo on a subgroup, so cpu_compat needs no collective shim (torch >= 2.3)."""
    results = run_dist(_sp_collectives, 4, timeout=60)
    for rank, (names, out) in enumerate(results):
        assert all(names.values()), names
        lo = 2 * (rank // 2)  # the pair's first rank: only the pair's tensors take part
        x = [torch.arange(4.0) + 10 * r for r in (lo, lo + 1)]
        for gathered, scattered in out.values():
            assert torch.equal(gathered, torch.cat(x))
            assert torch.equal(scattered, (x[0] + x[1]).chunk(2)[rank % 2])
