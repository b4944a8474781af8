"""What a resume does with each config field that changed since the checkpoint: refused or applied.

Every leaf field of `RunConfig` has one entry here (`tests/test_resume_changes.py` checks that the
table is complete, so a new field cannot be forgotten, and that docs/faults.md shows this table as
`resume_table()` prints it: `python -m megatron_bapo.resume_policy`).

- "refused": the checkpoint's state was built for the old value and cannot continue under the new
  one (the saved data position would index other prompts, the buffer holds groups of the old size,
  the optimizer state has another layout, the weights are another model's). `run_record.check_resume`
  stops the resume in one `checkpoint error:` line naming every such field, old -> new.
- "applied": the new value takes effect from the first resumed step, and the resume logs one
  `resume: <field> <old> -> <new>` line. Most fields are read where they act on every use; the
  others are re-applied over the state the checkpoint restores, as their entry says (the learning-rate
  schedule and the optimizer's hyperparameters: `actor.checkpoint.load_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator

REFUSED, APPLIED = "refused", "applied"

_LIVE = "read where it acts, every time"
_NEXT_SYNC = "used from the resumed run's first weight sync on"
_SERVERS = "used when the resumed run starts its servers and client"
_SCHEDULE = "the LR schedule is rebuilt from the new settings at the saved optimizer step (the checkpoint's scheduler values are overridden)"
_PARAM_GROUP = "set on every optimizer parameter group after the optimizer state is loaded"
_RESHARD = "megatron reshards model and optimizer state on load (one `resume: layout ...` line; RNG streams restart)"
_PROMPTS = "decides the prompt list the saved data position indexes"

_ROLE_FIELDS = {
    "model_path": "the resumed run starts the pool with the new model; groups scored before the checkpoint keep "
                  "what the old one gave them",
    **{name: _SERVERS for name in ("engine", "num_servers", "builtin_server_dtype", "builtin_server_decode_delay_ms",
                                   "client.urls", "client.router_url", "client.max_concurrency")},
    **{f"sglang.{name}": _SERVERS for name in ("python", "device", "gpu_ids", "tp_size", "dtype",
                                               "mem_fraction_static", "max_total_tokens", "extra_args")},
    **{f"client.{name}": _LIVE for name in ("request_timeout_s", "connect_timeout_s", "control_timeout_s",
                                            "max_retries", "backoff_s", "backoff_max_s", "unhealthy_cooldown_s",
                                            "health_timeout_s", "flush_cache_timeout_s")},
    "client.api_key": "never recorded (masked); whatever is set now is sent",
    "max_server_restarts": _LIVE,
}
"""What a resume does with a changed field of a role's pool (`teacher`, `judge`): all applied."""

POLICY: dict[str, tuple[str, str]] = {
    "model.hf_path": (REFUSED, "refused when its weights differ from the checkpoint's initial model (a fingerprint of "
                               "a few tensors' bytes, and the architecture and shapes); the same weights at another "
                               "path are applied (tokenizer and servers' start come from it)"),
    "data.path": (REFUSED, "refused when the file differs (size, sha256 of its first and last MiB); the same file at "
                           "another path is applied"),
    "data.prompt_key": (REFUSED, _PROMPTS),
    "data.answer_key": (REFUSED, _PROMPTS),
    "data.apply_chat_template": (REFUSED, _PROMPTS),
    "data.system_prompt": (REFUSED, _PROMPTS),
    "data.max_prompt_tokens": (REFUSED, _PROMPTS),
    "data.max_rows": (REFUSED, _PROMPTS),
    "data.shuffle": (APPLIED, "the order of the epoch being drawn is redrawn from the saved position on"),
    "data.seed": (APPLIED, "the order of the epoch being drawn is redrawn from the saved position on"),
    "trainer.output_dir": (APPLIED, "a copied run directory resumes; outputs go to the new one"),
    "trainer.total_steps": (APPLIED, _LIVE),
    "trainer.save_every": (APPLIED, _LIVE),
    "trainer.keep_checkpoints": (APPLIED, _LIVE),
    "trainer.resume": (APPLIED, _LIVE),
    "trainer.seed": (APPLIED, "per-request sampling seeds of segments sent after the resume derive from it"),
    "trainer.eval_at_start": (APPLIED, _LIVE),
    "trainer.async_steps": (APPLIED, "rounds produced ahead and saved are trained first; then the new depth"),
    "trainer.driver_process": (APPLIED, "where the driver runs; a checkpoint's driver state is the same either way"),
    "trainer.progress": (APPLIED, _LIVE),
    "trainer.console_every": (APPLIED, _LIVE),
    "trainer.log_level": (APPLIED, _LIVE),
    "trainer.max_steps_without_update": (APPLIED, _LIVE),
    "trainer.cpu_group_timeout_minutes": (APPLIED, "the CPU group is built with it at start"),
    "rollout.group_size": (REFUSED, "the partial-rollout buffer and the rounds produced ahead hold groups of the old size"),
    "rollout.prompts_per_step": (REFUSED, "the rounds produced ahead and the data position hold the old round size"),
    "rollout.max_response_tokens": (APPLIED, "buffered responses stop at the new limit (longer ones finish as truncated)"),
    "rollout.segment_tokens": (APPLIED, _LIVE),
    "rollout.max_staleness": (APPLIED, "tokens more versions behind than the new cap leave the loss from the first "
                                       "resumed step (judged per token at training time; the derived hard cap on "
                                       "buffered groups follows it)"),
    "rollout.max_group_staleness": (APPLIED, "buffered groups past the new hard cap are regenerated at the next round"),
    "rollout.max_context_tokens": (APPLIED, _LIVE),
    "rollout.sampling.temperature": (APPLIED, "new segments sample at it; tokens already buffered keep theirs"),
    "rollout.sampling.top_p": (APPLIED, _LIVE),
    "rollout.sampling.top_k": (APPLIED, _LIVE),
    "rollout.sampling.stop_token_ids": (APPLIED, _LIVE),
    "rollout.sampling.stop": (APPLIED, _LIVE),
    "rollout.sampling.ignore_eos": (APPLIED, _LIVE),
    "rollout.sampling.extra": (APPLIED, _LIVE),
    "rollout.deterministic_inference": (APPLIED, _LIVE),
    "rollout.return_routed_experts": (APPLIED, _LIVE),
    "rollout.num_builtin_servers": (APPLIED, _SERVERS),
    "rollout.builtin_server_dtype": (APPLIED, _SERVERS),
    "rollout.builtin_server_decode_delay_ms": (APPLIED, _SERVERS),
    "rollout.engine": (APPLIED, "the resumed run starts servers of the new engine and gives them the checkpoint's "
                                "weights, as at any start (both speak the same API)"),
    **{f"rollout.sglang.{name}": (APPLIED, _SERVERS)
       for name in ("python", "device", "gpu_ids", "tp_size", "dtype", "mem_fraction_static", "max_total_tokens",
                    "extra_args")},
    "rollout.client.urls": (APPLIED, _SERVERS),
    "rollout.client.router_url": (APPLIED, _SERVERS),
    "rollout.client.max_concurrency": (APPLIED, _SERVERS),
    "rollout.client.request_timeout_s": (APPLIED, _LIVE),
    "rollout.client.connect_timeout_s": (APPLIED, _LIVE),
    "rollout.client.control_timeout_s": (APPLIED, _LIVE),
    "rollout.client.max_retries": (APPLIED, _LIVE),
    "rollout.client.backoff_s": (APPLIED, _LIVE),
    "rollout.client.backoff_max_s": (APPLIED, _LIVE),
    "rollout.client.unhealthy_cooldown_s": (APPLIED, _LIVE),
    "rollout.client.health_timeout_s": (APPLIED, _LIVE),
    "rollout.client.flush_cache_timeout_s": (APPLIED, _LIVE),
    "rollout.client.api_key": (APPLIED, "never recorded (masked); whatever is set now is sent"),
    "rollout.max_failed_group_rate": (APPLIED, _LIVE),
    "rollout.max_server_restarts": (APPLIED, _LIVE),
    "rollout.dynamic_sampling": (APPLIED, "the first resumed step keeps, drops or refills under the new mode; groups an "
                                          "earlier refill carried over (scored, in the buffer) are trained first"),
    "rollout.max_refill_rounds": (APPLIED, _LIVE),
    "rollout.refill_headroom": (APPLIED, _LIVE),
    "rollout.agent.tools": (APPLIED, "calls made after the resume run against the new list (a pending call to a tool "
                                     "no longer listed gets the unknown-tool error message, as any such call does)"),
    "rollout.agent.max_turns": (APPLIED, "buffered multi-turn samples end at the new limit"),
    "rollout.agent.max_calls_per_turn": (APPLIED, _LIVE),
    "rollout.agent.tool_timeout_s": (APPLIED, _LIVE),
    "rollout.agent.num_tool_workers": (APPLIED, "the tool workers are started with it"),
    "rollout.agent.max_result_chars": (APPLIED, "results of calls run after the resume are cut at it"),
    "rollout.agent.allow_unisolated_python": (APPLIED, "the tool workers are started with it"),
    **{f"rollout.agent.format.{name}": (REFUSED, "buffered multi-turn samples were written in the old call and result "
                                                 "syntax: their next turns would mix two formats in one sample")
       for name in ("parser", "call_start", "call_end", "stop_at_call_end", "response_prefix", "response_template",
                    "response_separator", "response_suffix")},
    "reward.fn": (APPLIED, "scores responses finished after the resume"),
    "reward.num_workers": (APPLIED, _LIVE),
    "reward.timeout_s": (APPLIED, _LIVE),
    "reward.max_failure_rate": (APPLIED, _LIVE),
    "reward.overlong_buffer_tokens": (APPLIED, "shapes groups scored after the resume (buffered groups already scored "
                                               "keep their reward)"),
    "reward.overlong_penalty": (APPLIED, "shapes groups scored after the resume (buffered groups already scored keep "
                                         "their reward)"),
    **{f"reward.judge.{name}": (APPLIED, "the judge's client is built with it when the resumed run starts")
       for name in ("urls", "tokenizer", "max_concurrency")},
    "reward.judge.api_key": (APPLIED, "never recorded (masked); whatever is set now is sent"),
    **{f"reward.judge.{name}": (APPLIED, "verdicts asked for after the resume (buffered groups already scored keep "
                                         "their reward)")
       for name in ("template", "parse_regex", "values", "parse_fn", "max_new_tokens", "temperature", "timeout_s",
                    "on_failure")},
    "advantage.estimator": (APPLIED, _LIVE),
    "advantage.eps": (APPLIED, _LIVE),
    "actor.optim.name": (REFUSED, "the saved optimizer state belongs to the old optimizer"),
    "actor.optim.lr": (APPLIED, _SCHEDULE),
    "actor.optim.min_lr": (APPLIED, _SCHEDULE),
    "actor.optim.warmup_steps": (APPLIED, _SCHEDULE),
    "actor.optim.decay_style": (APPLIED, _SCHEDULE),
    "actor.optim.decay_steps": (APPLIED, _SCHEDULE),
    "actor.optim.weight_decay": (APPLIED, _SCHEDULE),
    "actor.optim.adam_beta1": (APPLIED, _PARAM_GROUP),
    "actor.optim.adam_beta2": (APPLIED, _PARAM_GROUP),
    "actor.optim.adam_eps": (APPLIED, _PARAM_GROUP),
    "actor.optim.sgd_momentum": (APPLIED, _PARAM_GROUP),
    "actor.optim.clip_grad": (APPLIED, _LIVE),
    **{f"actor.bapo.{name}": (APPLIED, "the bound search and the loss read it every optimizer step")
       for name in ("rho0", "low_start", "low_max", "high_start", "high_max", "high_step", "low_step",
                    "contribution", "weight", "metric", "order", "dual_clip")},
    "actor.parallel.tp": (APPLIED, _RESHARD),
    "actor.parallel.pp": (APPLIED, _RESHARD),
    "actor.parallel.cp": (APPLIED, _RESHARD),
    "actor.parallel.vpp": (APPLIED, _RESHARD),
    "actor.parallel.ep": (APPLIED, _RESHARD),
    "actor.parallel.etp": (APPLIED, _RESHARD),
    "actor.parallel.sequence_parallel": (APPLIED, _LIVE),
    "actor.parallel.backend": (APPLIED, _LIVE),
    "actor.parallel.timeout_minutes": (APPLIED, _LIVE),
    "actor.max_tokens_per_microbatch": (APPLIED, _LIVE),
    "actor.packing": (APPLIED, _LIVE),
    "actor.n_minibatches": (APPLIED, _LIVE),
    "actor.ppo_epochs": (APPLIED, _LIVE),
    "actor.search_scope": (APPLIED, _LIVE),
    "actor.loss_agg": (APPLIED, _LIVE),
    "actor.policy_loss": (APPLIED, "the loss (and what the bound search balances) of every optimizer step after the "
                                   "resume; the optimizer state carries over"),
    **{f"actor.{loss}.{name}": (APPLIED, "the loss and the bound search read it every optimizer step")
       for loss, names in (("dppo", ("divergence", "delta_low", "delta_high", "ratio_cap", "high_max", "high_step",
                                     "low_min", "low_step")),
                           ("cispo", ("c_low", "c_high")), ("sapo", ("tau_pos", "tau_neg")))
       for name in names},
    "actor.overlong_filter": (APPLIED, _LIVE),
    "actor.use_distributed_optimizer": (REFUSED, "the saved optimizer state has the other layout"),
    "actor.seed": (REFUSED, "the checkpoint restores the RNG streams seeded with the old value, so the new one "
                            "would not take effect"),
    "actor.dtype": (REFUSED, "the model and optimizer state were saved in the old precision"),
    "actor.logprob_chunk_size": (APPLIED, _LIVE),
    "actor.vocab_divisible_by": (REFUSED, "it pads the vocabulary: embedding and output layer change shape"),
    "actor.max_skipped_steps": (APPLIED, _LIVE),
    "actor.layer_spec": (APPLIED, "the checkpoint loads into either spec (TE's extra state is tolerated)"),
    "actor.old_logprobs": (APPLIED, _LIVE),
    "actor.correction.mode": (APPLIED, _LIVE),
    "actor.correction.tis_cap": (APPLIED, _LIVE),
    "actor.correction.band": (APPLIED, _LIVE),
    "actor.mismatch.band": (APPLIED, _LIVE),
    "actor.mismatch.warn_kl": (APPLIED, _LIVE),
    "actor.recompute": (APPLIED, _LIVE),
    "actor.routing_replay": (APPLIED, _LIVE),
    "actor.moe_aux_loss_coeff": (APPLIED, _LIVE),
    "sync.method": (APPLIED, _NEXT_SYNC),
    "sync.backend": (APPLIED, _NEXT_SYNC),
    "sync.master_address": (APPLIED, _NEXT_SYNC),
    "sync.master_port": (APPLIED, _NEXT_SYNC),
    "sync.bucket_bytes": (APPLIED, _NEXT_SYNC),
    "sync.keep_versions": (APPLIED, _NEXT_SYNC),
    "sync.pause_mode": (APPLIED, _NEXT_SYNC),
    "sync.group_timeout_s": (APPLIED, _NEXT_SYNC),
    "sync.verify": (APPLIED, _NEXT_SYNC),
    "sync.probe_max_kl": (APPLIED, _NEXT_SYNC),
    "sync.probe_tokens": (APPLIED, _NEXT_SYNC),
    **{f"eval.{name}": (APPLIED, "used at the next evaluation")
       for name in ("every_n_steps", "datasets", "n", "temperature", "top_p", "max_new_tokens", "reward",
                    "max_prompt_tokens", "max_problems", "concurrency")},
    "bapo_preset": (APPLIED, "fills the actor.bapo.* fields, each applied (and listed) as above"),
    **{f"{role}.{name}": (APPLIED, how) for role in ("teacher", "judge") for name, how in _ROLE_FIELDS.items()},
    "distill.coef": (APPLIED, "the advantages of every batch built after the resume"),
    "distill.reward_coef": (APPLIED, "the advantages of every batch built after the resume"),
}
SILENT = ("trainer.resume",)
"""Changed on every resume by its nature: no `resume:` line."""
PATH_FIELDS = ("model.hf_path", "data.path")
"""Checked by content, not by value (`run_record.check_resume`)."""


def leaf_fields(cls: Any = None, prefix: str = "") -> Iterator[str]:
    """Every leaf field of `RunConfig` as a dotted name (nested dataclasses expanded)."""
    if cls is None:
        from megatron_bapo.config import RunConfig

        cls = RunConfig
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A resolved config as `{dotted field: value}` (a dict-valued field such as
    `rollout.sampling.extra` or `reward.judge.values` stays one value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = prefix + key
        if isinstance(value, dict) and name not in ("rollout.sampling.extra", "reward.judge.values"):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def resume_table() -> str:
    """The markdown table docs/faults.md shows (every field, what a resume does when it changed)."""
    rows = ["| field | on resume | how |", "|---|---|---|"]
    for name in leaf_fields():
        kind, how = POLICY.get(name, ("MISSING", "not in megatron_bapo/resume_policy.py"))
        rows.append(f"| `{name}` | {kind} | {how} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(resume_table(), end="")
