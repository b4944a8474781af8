"""Megatron actor: vocab-parallel log-probs/entropy, the BAPO train step, checkpoints.

`Actor` and `ActorConfig` import megatron-core lazily (attribute access), so the package stays
importable for config parsing without it.
"""

from megatron_bapo.actor.config import ActorConfig, OptimConfig

__all__ = ["Actor", "ActorConfig", "OptimConfig"]


def __getattr__(name: str):
    if name == "Actor":
        from megatron_bapo.actor.actor import Actor

        return Actor
    raise AttributeError(name)
