"""Make megatron-core run on a CPU-only torch (gloo), and nothing else.

megatron-core assumes CUDA in a handful of places. This module is the only place in the project
that patches anything, it is active only when `torch.cuda.is_available()` is False, and each shim
below was verified necessary by a probe (shared/notes/megatron-core-on-cpu.md):

| shim                                                         | needed by                          |
|--------------------------------------------------------------|------------------------------------|
| `torch.cuda.current_device()` -> `torch.device("cpu")`       | RoPE, TP layers, p2p, DDP buffers  |
| `torch.cuda.synchronize()` -> no-op                          | PP p2p, checkpointing              |
| a global TorchFunctionMode: `device="cuda"`, `.cuda()`,      | PP schedules, optimizer, grad      |
|   `.to("cuda")`, `pin_memory=True` -> CPU; `Tensor.type()`   |   clipping, fully-parallel load    |
|   reports `torch.cuda.*` (megatron's optimizers check it)    |                                    |
| a CPU RNG tracker (`add`/`fork` swap the CPU generator)      | model_parallel_cuda_manual_seed    |
| megatron's `_get/_set_cuda_rng_state` -> the CPU generator   | activation recompute (checkpoint)  |
| `torch.cuda.Stream`, `current_stream`, `stream(...)` -> one  | MoE all-to-all token dispatcher    |
|   CPU stream whose events are always complete                |   (copies split sizes on a stream) |
| the dispatcher's `maybe_move_tensor_to_cpu`: split sizes as  | MoE all-to-all (gloo's             |
|   numpy arrays, as it hands them to all_to_all_single on GPU |   all_to_all_single takes lists)   |
| megatron's MoE utilities' Transformer Engine names -> None   | MoE router (moe_utils reads        |
|   where TE is not installed                                  |   `te_general_gemm` unguarded)     |
| uneven all-gather / reduce-scatter along the first dim over  | MoE under expert-tensor parallel:  |
|   gloo: pad + all_gather_into_tensor / all_reduce + slice    |   tokens per ETP rank differ; gloo |
|   (equal splits keep megatron's own path)                    |   needs equal sizes                |

The fifth ingredient, core attention via `scaled_dot_product_attention`, lives in the layer spec
(`megatron_bapo.models.layer_spec`), not here, because it is a module choice, not a patch. So does
the norm that makes sequence parallelism work without Apex/TE (`SpTorchNorm`).

Sequence parallelism needs no collective shim: megatron's `dist_all_gather_func` /
`dist_reduce_scatter_func` (tensor_parallel/mappings.py:12-13, layers.py:79-80) are
`all_gather_into_tensor` / `reduce_scatter_tensor`, which gloo implements natively on subgroups,
sync and async (torch >= 2.3; setup.py requires >= 2.4). tests/test_cpu_compat.py checks that.

The MoE token dispatcher runs as on GPUs (`alltoall`): gloo implements `all_to_all_single` with
uneven splits, the expert-parallel exchange of tokens and their gradients (tests/test_qwen3_moe.py).

Any other CUDA call still raises torch's "not compiled with CUDA" error, so a code path that starts
to need a new shim fails loudly in the tests instead of silently running somewhere else.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_INSTALLED = False
_MODE: "_CpuDeviceMode | None" = None
_HITS: Counter = Counter()
"""How often each shim fired (for tests and debugging; never used for control flow)."""


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an integer device index means a CUDA ordinal
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Redirects CUDA placement requests to the CPU and reports CPU tensors as `torch.cuda.*`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
            _HITS["device_kwarg"] += 1
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            _HITS["pin_memory"] += 1
        if func is torch.Tensor.cuda:
            _HITS["tensor.cuda"] += 1
            return args[0]
        if func is torch.Tensor.pin_memory:
            _HITS["tensor.pin_memory"] += 1
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            _HITS["tensor.to"] += 1
            args = (args[0], torch.device("cpu"), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            name = func(*args, **kwargs)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                _HITS["tensor.type"] += 1
                return "torch.cuda." + name[len("torch.") :]
            return name
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    _HITS["current_device"] += 1
    return torch.device("cpu")


def _synchronize(device: Any = None) -> None:
    _HITS["synchronize"] += 1


def _get_device_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """On CPU the "device" generator is the CPU generator (the tracker above swaps the same one)."""
    _HITS["rng_state"] += 1
    return torch.get_rng_state()


def _set_device_rng_state(new_state: Any, device: int = -1, graph_safe: bool = False) -> None:
    _HITS["rng_state"] += 1
    torch.set_rng_state(new_state)


class _CpuEvent:
    """A CUDA event stand-in: work on the CPU is complete when it is recorded."""

    def synchronize(self) -> None:
        _HITS["event"] += 1

    def wait(self, stream: Any = None) -> None:
        _HITS["event"] += 1

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream stand-in: everything runs in order on the CPU, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _HITS["stream"] += 1

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _CPU_STREAM


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _dispatcher_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` for CPU tensors: on GPUs the dispatcher's split sizes
    arrive here as CUDA tensors and leave as numpy arrays (`as_numpy`), the form `all_to_all_single`
    takes; CPU tensors would pass through unchanged, which gloo's binding refuses."""
    if torch.is_tensor(tensor) and as_numpy:
        _HITS["split_sizes"] += 1
        return tensor.detach().cpu().numpy()
    return tensor


_MOE_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute")
"""Transformer Engine functions megatron-core 0.16's `moe_utils` imports only when TE is installed but
tests for `is not None` (so without TE the router's gating raises NameError)."""


def _uneven_gather_shim(original):
    """megatron's `_gather_along_first_dim` whose uneven branch (`output_split_sizes`) gloo refuses
    (its allgather needs equal sizes): every rank pads its part to the largest, all-gathers into one
    tensor and keeps each rank's real rows. The same values in the same order as NCCL's list gather."""
    import torch.distributed as dist

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        _HITS["uneven_gather"] += 1
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * longest: r * longest + n] for r, n in enumerate(sizes)])

    return gather


def _uneven_reduce_scatter_shim(original):
    """megatron's `_reduce_scatter_along_first_dim` whose uneven branch (`input_split_sizes`, a list
    reduce-scatter) gloo does not implement: all-reduce the whole tensor, keep this rank's rows."""
    import torch.distributed as dist

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        _HITS["uneven_reduce_scatter"] += 1
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(int(n) for n in input_split_sizes[: group.rank()])
        return total[start: start + int(input_split_sizes[group.rank()])].clone()

    return reduce_scatter


def _install_moe_shims() -> None:
    try:
        from megatron.core.tensor_parallel import mappings
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:  # megatron-core absent
        return
    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    token_dispatcher.maybe_move_tensor_to_cpu = _dispatcher_tensor_to_host
    mappings._gather_along_first_dim = _uneven_gather_shim(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter_shim(mappings._reduce_scatter_along_first_dim)


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` whose named states are CPU generator states.

        `fork(name)` swaps the CPU generator to the named state and back, so dropout inside TP regions
        draws from per-TP-rank streams exactly as it would from the CUDA generator on GPUs.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def install() -> bool:
    """Install the CPU shims once per process; a no-op when CUDA is available or already installed.

    Returns True when the shims are active after the call. Safe to call from every entry point
    (tests, trainer, tools). Forked children inherit the installed state.
    """
    global _INSTALLED, _MODE
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _INSTALLED:
            return True
        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize
        torch.cuda.Stream = _CpuStream
        torch.cuda.current_stream = _current_stream
        torch.cuda.stream = _stream_context
        _install_moe_shims()
        try:
            from megatron.core.tensor_parallel import random as mrandom
        except ImportError:  # megatron-core absent: the device shims alone are still useful
            mrandom = None
        if mrandom is not None:
            tracker_cls = _make_cpu_tracker_class()
            # Fresh trackers (initialize_rng_tracker, force_reset) are built from this module global.
            mrandom.CudaRNGStatesTracker = tracker_cls
            mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
            # Recompute (CheckpointFunction) saves and restores the device RNG around each layer.
            mrandom._get_cuda_rng_state = _get_device_rng_state
            mrandom._set_cuda_rng_state = _set_device_rng_state
        _MODE = _CpuDeviceMode()
        _MODE.__enter__()  # stays entered for the life of the process (this thread)
        _INSTALLED = True
        logger.info("megatron_bapo.models.cpu_compat: CPU shims installed (CUDA not available)")
        return True


def is_installed() -> bool:
    """True when `install()` has activated the shims in this process."""
    return _INSTALLED


def shim_hits() -> dict[str, int]:
    """Counts of shim activations so far (diagnostics)."""
    return dict(_HITS)
