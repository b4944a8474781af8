"""Host tensors never cross a group that would be an NCCL group on GPUs (tests/strict_devices.py).

NCCL has no host tensors; gloo (every CPU test) takes anything. Under `StrictDevices` megatron's
default-backend groups are device groups that refuse host tensors, as NCCL would, while its `*_gloo`
groups take them. The actor's step with DP x CP > 1 ran its bound search on host log-probs over the
DP x CP group until this was caught (0fba64c: the first GPU step of the 32B recipe would crash).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from strict_devices import HostTensorOnDeviceGroup, StrictDevices  # noqa: E402
from test_actor_helpers import TINY_QWEN2, make_batch  # noqa: E402


def _checker(rank, world_size):
    from megatron.core import parallel_state as ps

    from megatron_bapo.algorithms import BapoConfig, search_clip_bounds

    out = {}
    with StrictDevices() as sd:
        ps.initialize_model_parallel(create_gloo_process_groups=True)
        group = ps.get_data_parallel_group(with_context_parallel=True)
        gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True)
        out["backends"] = (str(dist.get_backend(group)), str(dist.get_backend(gloo)))
        device = torch.ones(3, device="cuda")
        host = torch.ones(3)
        out["placement"] = (device.device.type, torch.zeros(2, device=device.device).device.type,
                            (device * 2).is_cuda, device.cpu().is_cuda, host.cuda().is_cuda, host.is_cuda)
        dist.all_reduce(device, group=group)
        dist.all_reduce(host, group=gloo)
        refused = []
        for name, t in (("host", torch.ones(3)), ("copied back", device.cpu()), ("from a list", torch.tensor([1.0]))):
            try:
                dist.all_reduce(t, group=group)
            except HostTensorOnDeviceGroup as exc:
                refused.append((name, "DATA_PARALLEL_GROUP_WITH_CP" in str(exc)))
        out["refused"] = refused
        # The bound search reduces on whatever device its group carries, from host or device inputs.
        g = torch.Generator().manual_seed(rank)
        ratio, adv = torch.exp(0.2 * torch.randn(64, generator=g)), torch.randn(64, generator=g)
        mask = torch.ones(64)
        cfg = BapoConfig()
        host_res = search_clip_bounds(ratio, adv, mask, cfg, group=group)
        dev_res = search_clip_bounds(ratio.cuda(), adv.cuda(), mask.cuda(), cfg, group=gloo)
        out["search"] = (host_res, dev_res)
        out["collectives"] = dict(sd.collectives)
    return out


def test_checker_refuses_host_tensors_on_device_groups_only(run_dist):
    for res in run_dist(_checker, 2, timeout=120):
        assert res["backends"] == ("nccl", "gloo")
        assert res["placement"] == ("cuda", "cuda", True, False, True, False)
        assert res["refused"] == [("host", True), ("copied back", True), ("from a list", True)]
        host_res, dev_res = res["search"]
        assert host_res == dev_res and host_res.num_tokens == 128  # both ranks' tokens, either way


def _train(rank, world_size, layout, scope):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    with StrictDevices() as sd:
        cfg = ActorConfig(optim=OptimConfig(lr=1e-3), parallel=ParallelConfig(**layout), search_scope=scope,
                          max_tokens_per_microbatch=64, n_minibatches=2)
        actor = Actor(cfg, TINY_QWEN2)
        batch = make_batch(num_seqs=8, max_len=24)  # a host batch, as the trainer's
        metrics = actor.train_step(batch)
        lp = actor.compute_logprobs(batch)
        return {"metrics": metrics, "lp": lp, "collectives": dict(sd.collectives)}


@pytest.mark.parametrize("scope", ["minibatch", "microbatch"])
def test_actor_step_sends_no_host_tensor_over_device_groups(run_dist, scope):
    """DP 2 with the distributed optimizer: the search's one all-reduce over DP x CP carries device
    tensors (at 0fba64c: host log-probs, refused here)."""
    results = run_dist(_train, 2, {}, scope, timeout=180)
    for res in results:
        assert res["metrics"]["bapo/c_high"] >= 1.2
        assert res["collectives"][("all_reduce", "DATA_PARALLEL_GROUP_WITH_CP")] >= 2  # searches at least
    torch.testing.assert_close(results[0]["lp"], results[1]["lp"], atol=0, rtol=0)


def _export(rank, world_size, out):
    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert.live import save_model_as_hf
    from megatron_bapo.models.parallel import ParallelConfig

    with StrictDevices() as sd:
        actor = Actor(ActorConfig(parallel=ParallelConfig(pp=2)), TINY_QWEN2)
        save_model_as_hf(actor.model, TINY_QWEN2, out, parallel=actor.parallel)
        return dict(sd.collectives)


def test_weight_export_across_pipeline_stages_sends_device_tensors(run_dist, tmp_path):
    """The weight sync's gather (stage 1 sends its layers to stage 0) allocates its receive buffers
    on the parameters' device."""
    for collectives in run_dist(_export, 2, tmp_path / "hf", timeout=120):
        assert collectives[("send" if collectives.get(("send", "PIPELINE_MODEL_PARALLEL_GROUP")) else "recv",
                            "PIPELINE_MODEL_PARALLEL_GROUP")] > 0
    assert (tmp_path / "hf" / "config.json").is_file()
