"""Rollout: SGLang client, group sampling with partial rollout, actor batches.

Public API (the trainer's view)::

    from megatron_bapo.rollout import (RolloutClientConfig, RolloutClient, PartialRolloutConfig,
        SamplingConfig, PartialRolloutManager, Prompt, Sample, SampleState, RolloutGroup,
        build_batch, flatten, RolloutError, RequestRejected)

    client = RolloutClient(RolloutClientConfig(urls=["http://127.0.0.1:30000", ...]))
    client.wait_healthy()                                   # /health_generate on every worker
    client.update_weights_from_disk(hf_dir, version)        # every worker; version int -> "str" on the wire
    client.get_weight_version() -> int | None               # via /model_info (None = "default")
    client.flush_cache(); client.abort_all()
    client.pause_generation(); client.continue_generation()
    client.close()                                          # or `with RolloutClient(...) as client:`

    manager = PartialRolloutManager(client, PartialRolloutConfig(group_size=8,
        max_response_tokens=1024, segment_tokens=256, max_staleness=2, sampling=SamplingConfig()))
    done = manager.step(prompts, version)     # a RolloutRound: .groups (all G samples finished), .metrics
    manager.state_dict() / manager.load_state_dict(d)       # JSON-safe partial-rollout buffer
    manager.abort()                                         # from another thread: stop the running step

    batch = build_batch(flatten(groups), pad_token_id=..., advantages=per_sample_adv)
    # input_ids, attention_mask, loss_mask, behavior_logprobs, versions, advantages: [B, T]
    # aligned to the token, right-padded; prompt_lengths, response_lengths: [B]

Rank 0 of the trainer reaches the servers only through `rollout.pool.ServerPool` (life, restarts,
pauses, weight updates, the served version), which holds the client. Every control call also has a coroutine (`aupdate_weights_from_disk`, ...) and generation is
`await client.agenerate(input_ids, sampling_params) -> GenerateResult`; sync methods run them on
the client's own background event loop. Prompts come from `megatron_bapo.data.PromptDataset`.
"""

from megatron_bapo.rollout.batch import build_batch
from megatron_bapo.rollout.client import RolloutClient
from megatron_bapo.rollout.config import SAMPLING_KEYS, PartialRolloutConfig, RolloutClientConfig, SamplingConfig
from megatron_bapo.rollout.errors import ProtocolError, RequestRejected, RolloutError
from megatron_bapo.rollout.partial import PartialRolloutManager, flatten
from megatron_bapo.rollout.protocol import parse_generate_reply, parse_version
from megatron_bapo.rollout.types import GenerateResult, Prompt, RolloutGroup, RolloutRound, Sample, SampleState

__all__ = [
    "SAMPLING_KEYS", "GenerateResult", "PartialRolloutConfig", "PartialRolloutManager", "Prompt",
    "ProtocolError", "RequestRejected", "RolloutClient", "RolloutClientConfig", "RolloutError",
    "RolloutGroup", "RolloutRound", "Sample", "SampleState", "SamplingConfig", "build_batch", "flatten",
    "parse_generate_reply", "parse_version",
]
