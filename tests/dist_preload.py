"""What the fork server behind `dist_harness.run_dist` imports once, so every rank it forks starts
with torch, megatron-core (with the CPU compatibility layer) and the actor already loaded."""

import torch

try:
    from megatron_bapo.models import cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.install()
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron_bapo.actor.actor  # noqa: F401 - the heaviest import most ranks need
except ImportError:  # a test without megatron-core imports what it needs itself
    pass
