"""Shared test setup.

Imports torch (and megatron-core when installed) once in the parent (and, through `dist_preload`, in the fork server multi-rank workers start from) so they
start fast, installs the CPU compatibility layer when CUDA is absent, and skips `gpu` tests
without CUDA.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from dist_harness import run_dist as _run_dist  # noqa: E402

if not torch.cuda.is_available():
    try:
        from megatron_bapo.models import cpu_compat

        cpu_compat.install()
    except ImportError:
        pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Multi-rank workers fork from this process: a process group a test leaves registered here is
    inherited by every later fork (CI at 8c08bf2: a weight group's name, left by one test, failed
    another's group of that name). Fail the test that leaves one, not the innocent one after it."""
    yield
    from torch.distributed.distributed_c10d import _world

    left = sorted(str(name) for name in _world.pg_names.values())
    if left or torch.distributed.is_initialized():
        pytest.fail(f"process group(s) left registered in the pytest process: {left or ['default']}; destroy them "
                    f"(megatron_bapo.weight_update.destroy_weights_update_group / dist.destroy_process_group)")


@pytest.fixture
def run_dist():
    """`run_dist(fn, world_size, *args, timeout=...)`: fn(rank, world_size, *args) on forked gloo ranks."""
    return _run_dist


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Qwen2 HF checkpoint (config, safetensors, char-level tokenizer) on disk.

    Built with the project's own tool (megatron_bapo.tiny), loadable by transformers' Auto classes.
    """
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=0)
