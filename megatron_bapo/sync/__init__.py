"""Trainer-side weight sync to the rollout servers (design section 3 step 7).

Two transports, one per file:
- `disk.DiskWeightSync`: the actor writes an HF safetensors directory (atomic rename), every server
  loads it with `/update_weights_from_disk` and takes the new `weight_version`. Needs a file system
  shared by trainer and servers; the one-machine default.
- `distributed.DistributedWeightSync`: trainer rank 0 and every server TP rank form one torch
  process group (`/init_weights_update_group`, NCCL on GPUs, gloo on CPU); each bucket of HF-named
  tensors is announced with `/update_weights_from_distributed` and broadcast from rank 0. No disk.
  The protocol itself (join, announce + broadcast, leave) is `sender.DistributedWeightSender`.
Both are collective over all actor ranks (weights are gathered over TP/PP); only global rank 0
talks HTTP, through the rollout client (the one client of the servers). How an update meets
requests in flight (`sync.pause_mode`) is `pause.paused`.
"""

from megatron_bapo.sync.disk import DiskWeightSync
from megatron_bapo.sync.distributed import DistributedWeightSync
from megatron_bapo.sync.pause import PAUSE_MODES, paused
from megatron_bapo.sync.sender import DistributedWeightSender

__all__ = ["PAUSE_MODES", "DiskWeightSync", "DistributedWeightSender", "DistributedWeightSync", "paused"]
