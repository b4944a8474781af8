"""Virtual CUDA on CPU: find host tensors sent over groups that would be NCCL groups on GPUs.

gloo forgives what NCCL refuses: on a GPU cluster megatron creates its process groups with the
default backend (NCCL), which carries only device tensors, while the `*_gloo` groups it creates
explicitly carry host tensors. On a CPU every group is gloo and every tensor is a host tensor, so a
`.cpu()` before an all-reduce over the data-parallel group passes every CPU test and crashes the
first GPU step. `StrictDevices` makes the difference visible on CPU:

- a tensor is a DEVICE tensor when it was created for CUDA (`device="cuda"`, an int ordinal,
  `torch.cuda.current_device()`, `.cuda()`, `.to("cuda")`: requests the CPU shim in
  `megatron_bapo.models.cpu_compat` redirects to the CPU) or computed from a device tensor; model
  parameters are device tensors (on GPUs the model is built on or moved to the device);
- a HOST tensor is one created without a device (torch's default device is the CPU on GPU
  machines too), with `device="cpu"`, or by `.cpu()` / `.to("cpu")` of anything (a copy, as on
  GPUs); results of host-only inputs are host tensors;
- device tensors report `device == cuda:0` and `is_cuda`, so `torch.zeros(n, device=x.device)`
  follows `x` as it would on a GPU; in-place ops never change where a tensor lives;
- groups created by `torch.distributed.new_group` without `backend="gloo"` (what megatron's
  `create_group` does for every non-`*_gloo` group) and the default (world) group are DEVICE
  groups: `torch.distributed.get_backend` reports "nccl" for them, and a collective or p2p op on
  one raises `HostTensorOnDeviceGroup` when it is handed a host tensor.

Tensors of unknown origin (made before the checker was entered, or by autograd in C++) are not
judged, and neither are the ops inside `backward()` (torch runs it with every mode popped; megatron's
backward collectives carry autograd's gradients, device tensors on GPUs). Enter it in a worker BEFORE megatron creates its groups (so they are recorded) and before
the test builds its data (so the data is host data, as a trainer's batch is).
"""

from __future__ import annotations

import inspect
import sys
import traceback
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

DEVICE, HOST = "device", "host"
_ATTR = "_strict_devices_where"
_DEVICE_GETTER = torch._C.TensorBase.__dict__["device"]
_IS_CUDA_GETTER = torch._C.TensorBase.__dict__["is_cuda"]
_COLLECTIVES = {
    getattr(dist, name): name
    for name in (
        "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_single",
        "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_single", "all_to_all",
        "all_to_all_single", "send", "recv", "isend", "irecv",
    )
    if hasattr(dist, name)
}


_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list"}


def _inside_object_collective() -> bool:
    """torch's object collectives pick the device for their byte tensors from the real backend (gloo
    here, NCCL on GPUs, where they use device tensors): they are legal on any group."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name in _OBJECT_COLLECTIVES and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


class HostTensorOnDeviceGroup(RuntimeError):
    """A host tensor was handed to a collective over a group that NCCL would run on GPUs."""


def _is_cuda_request(device: Any) -> Optional[bool]:
    """True for a CUDA placement request, False for an explicit CPU one, None when not a device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda") if device.split(":")[0] in ("cuda", "cpu") else None
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return None


def where(t: torch.Tensor) -> Optional[str]:
    """DEVICE, HOST or None (unknown) for a tensor under the checker."""
    if isinstance(t, torch.nn.Parameter):
        return DEVICE
    return t.__dict__.get(_ATTR) if hasattr(t, "__dict__") else None


def _mark(t: torch.Tensor, value: Optional[str]) -> None:
    if value is not None and not isinstance(t, torch.nn.Parameter):
        t.__dict__[_ATTR] = value


def _tensors(obj: Any, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


class StrictDevices(TorchFunctionMode):
    """Context manager: virtual CUDA placement on CPU, and device groups that refuse host tensors.

    `collectives` counts `(op name, group description)` pairs issued while it is active.
    """

    def __init__(self) -> None:
        super().__init__()
        self.device_groups: dict[int, str] = {}
        self.collectives: Counter = Counter()
        self._saved: dict[str, Any] = {}

    # ------------------------------------------------------------------ groups
    def is_device_group(self, group: Any) -> bool:
        if group is None or group is dist.group.WORLD:
            return True  # the default group: NCCL on GPUs (ParallelConfig.backend "auto")
        return id(group) in self.device_groups

    def describe(self, group: Any) -> str:
        if group is None or group is dist.group.WORLD:
            return "WORLD"
        return self.device_groups.get(id(group)) or getattr(group, "group_desc", None) or "gloo group"

    def __enter__(self):
        if not torch.distributed.is_initialized():
            raise RuntimeError("StrictDevices: initialise torch.distributed first (the world is a device group)")
        new_group, get_backend = dist.new_group, dist.get_backend

        def recording_new_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if backend in (None, "nccl") and isinstance(group, dist.ProcessGroup):
                self.device_groups[id(group)] = kwargs.get("group_desc") or "device group"
            return group

        def reporting_get_backend(group=None):
            return "nccl" if self.is_device_group(group) else get_backend(group)

        self._saved = {"new_group": new_group, "get_backend": get_backend,
                       "current_device": torch.cuda.current_device, "nccl_version": torch.cuda.nccl.version}
        dist.new_group = recording_new_group
        dist.get_backend = reporting_get_backend
        # torch's collective error logger asks for the NCCL version of an "nccl" group.
        torch.cuda.nccl.version = lambda: (0, 0, 0)
        cpu_current_device = torch.cuda.current_device

        def current_device():
            # An ordinal (a CUDA request the CPU shim redirects) where the modes are active; inside
            # autograd's backward, which torch runs with every mode popped, the shim's CPU device.
            return 0 if any(m is self for m in _get_current_function_mode_stack()) else cpu_current_device()

        torch.cuda.current_device = current_device
        return super().__enter__()

    def __exit__(self, *exc):
        dist.new_group = self._saved["new_group"]
        dist.get_backend = self._saved["get_backend"]
        torch.cuda.current_device = self._saved["current_device"]
        torch.cuda.nccl.version = self._saved["nccl_version"]
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ tensors
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE_GETTER and func.__name__ == "__get__":
            return torch.device("cuda", 0) if where(args[0]) == DEVICE else func(*args, **kwargs)
        if owner is _IS_CUDA_GETTER and func.__name__ == "__get__":
            return where(args[0]) == DEVICE
        if func in _COLLECTIVES:
            self._check_collective(func, args, kwargs)
            return func(*args, **kwargs)
        target = self._requested(func, args, kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        result = func(*args, **kwargs)
        if func is torch.Tensor.cpu or func is torch.Tensor.cuda or (func is torch.Tensor.to and target is not None):
            src = args[0]
            if result is src and where(src) != target:
                result = result.clone()  # a transfer is a copy on GPUs; never re-label the source
            _mark(result, target)
            return result
        if target is None:
            marks = {where(t) for t in inputs}
            target = DEVICE if DEVICE in marks else HOST if (HOST in marks or not inputs) else None
        for out in _tensors(result):
            if where(out) is None:
                _mark(out, target)
        return result

    @staticmethod
    def _requested(func, args, kwargs) -> Optional[str]:
        """DEVICE / HOST when the call asks for a placement, else None."""
        if func is torch.Tensor.cpu:
            return HOST
        if func is torch.Tensor.cuda:
            return DEVICE
        candidates = [kwargs.get("device")]
        if func is torch.Tensor.to:
            candidates += list(args[1:2])
        for c in candidates:
            if isinstance(c, torch.Tensor) and func is torch.Tensor.to:
                return where(c)
            req = _is_cuda_request(c)
            if req is not None:
                return DEVICE if req else HOST
        return None

    def _check_collective(self, func, args, kwargs) -> None:
        name = _COLLECTIVES[func]
        try:
            bound = inspect.signature(func).bind(*args, **kwargs)
            params = bound.arguments
        except TypeError:
            params = dict(kwargs)
        group = params.get("group")
        self.collectives[(name, self.describe(group))] += 1
        if not self.is_device_group(group) or _inside_object_collective():
            return
        hosts = [t for t in _tensors(list(params.values())) if where(t) == HOST]
        if hosts:
            stack = "".join(traceback.format_stack(limit=8)[:-2])
            raise HostTensorOnDeviceGroup(
                f"{name} over {self.describe(group)} (NCCL on GPUs) got a host tensor "
                f"{tuple(hosts[0].shape)} {hosts[0].dtype}; keep it on the device or use a gloo group\n{stack}"
            )
