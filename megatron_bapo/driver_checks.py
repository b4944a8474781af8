"""What the driver checks before a run spends minutes loading the model or training nothing: the
paths and reward/tool functions a config names, the servers' context against the longest request,
and the shape of the MoE routing a run records. Errors are one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_bapo.config import RunConfig
from megatron_bapo.config_io import ConfigError
from megatron_bapo.rewards.judge_config import JUDGE
from megatron_bapo.rollout.teacher import check_same_tokenizer


def preflight(cfg: RunConfig) -> None:
    """What would otherwise fail only after the model loads (minutes on a cluster): paths and the
    reward functions. Errors name the field and are one line."""
    from megatron_bapo.rewards import load_reward_fn
    from megatron_bapo.rollout.tools import ToolSpecError, load_tool_fn

    if not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path={cfg.data.path!r} does not exist")
    if cfg.reward.fn != JUDGE:
        load_reward_fn(cfg.reward.fn)  # RewardSpecError naming reward.fn
    if cfg.teacher.enabled:  # the teacher scores the student's token ids: one tokenizer, or refused
        check_same_tokenizer(cfg.model.hf_path, cfg.teacher.model_path)
    for i, tool in enumerate(cfg.rollout.agent.tools):
        try:
            load_tool_fn(tool.fn)
        except ToolSpecError as exc:
            raise ConfigError(f"rollout.agent.tools[{i}].fn={tool.fn!r}: {exc}") from None
    if cfg.eval.every_n_steps and cfg.eval.datasets:
        for i, ds in enumerate(cfg.eval.datasets):
            if not Path(ds.path).exists():
                raise ConfigError(f"eval.datasets[{i}].path={ds.path!r} does not exist")
        if isinstance(cfg.eval.reward, str) and cfg.eval.reward != JUDGE:
            load_reward_fn(cfg.eval.reward)


def check_context(cfg: RunConfig, prompts: Sequence[Any], client: Any, teacher: Optional[Any] = None) -> None:
    """The longest prompt plus `rollout.max_response_tokens` must fit every server's context (the
    `teacher` client's too, as the input of its prefill: one position more); otherwise every request
    would come back 400 and the run would train nothing."""
    ro = cfg.rollout
    longest = max(len(p.prompt_ids) for p in prompts)
    prompt = max(longest, cfg.data.max_prompt_tokens or 0)
    clients = [(client, 0, "server"), *([(teacher, 1, "teacher server")] if teacher is not None else [])]
    for each, extra, kind in clients:
        for url, info in each.run(each.aget_server_info()).items():
            max_input = info.get("max_req_input_len")
            ctx = info.get("context_length") or (max_input + 1 if max_input else None)
            if ctx and prompt + ro.max_response_tokens + extra > ctx:
                raise ConfigError(
                    f"rollout.max_response_tokens={ro.max_response_tokens} + the longest prompt ({prompt} tokens, "
                    f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}) = "
                    f"{prompt + ro.max_response_tokens} exceeds the context length {ctx} of {kind} {url}"
                    f"{' (less one: a prefill input)' if extra else ''}: every request would be rejected. Lower "
                    f"rollout.max_response_tokens or data.max_prompt_tokens, or serve a longer context")


def routing_shape(hf_path: str) -> tuple[int, int]:
    """(num_layers, top_k) of the recorded MoE routing (`rollout.return_routed_experts`)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_path)
    top_k = getattr(hf, "num_experts_per_tok", None)
    if not top_k:
        raise ConfigError(f"rollout.return_routed_experts=true, but model.hf_path={hf_path!r} is not a "
                          f"mixture-of-experts model (no num_experts_per_tok); set it to false")
    return int(hf.num_hidden_layers), int(top_k)
