"""Run evaluations: the in-training hook (`run_evaluation`) and the standalone driver behind
`tools/evaluate.py` (`evaluate_checkpoint`), which starts the built-in server when no URL is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from megatron_bapo.eval.config import EvalConfig, EvalDatasetConfig
from megatron_bapo.eval.core import EvalProblem, Prompt, evaluate_records, load_problems, write_records
from megatron_bapo.eval.sampling import AgentSampler, ClientSampler, Sampler, SamplingError, sample_all

logger = logging.getLogger(__name__)


def prompt_to_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: chat messages go through the tokenizer's chat template (with the
    generation prompt); plain text is tokenized as is (no template, no added special tokens)."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def as_sampler(client: Any) -> Sampler:
    """A `RolloutClient` through `ClientSampler`; anything with `async generate(input_ids,
    sampling_params) -> Sample` as is."""
    if hasattr(client, "agenerate"):
        return ClientSampler(client)
    if hasattr(client, "generate") and asyncio.iscoroutinefunction(client.generate):
        return client
    raise TypeError(f"{type(client).__name__} has no `async generate(input_ids, sampling_params)`; wrap it")


async def evaluate_dataset(
    sampler: Union[Sampler, AgentSampler],
    tokenizer: Any,
    problems: Sequence[EvalProblem],
    config: EvalConfig,
    *,
    name: str = "eval",
    judge: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Sample `config.n` responses per problem, score them; (records, unprefixed metrics). An
    `AgentSampler` runs each response through the agent loop (tools, several turns). `judge` (a
    `rewards.judge.JudgeReward`, for `eval.reward: judge`) grades instead of a reward function,
    reading each prompt as the policy saw it (decoded without special tokens), as in training."""
    kept, ids = [], []
    num_too_long = 0
    for problem in problems:
        prompt_ids = prompt_to_ids(tokenizer, problem.prompt)
        if not prompt_ids or (config.max_prompt_tokens is not None and len(prompt_ids) > config.max_prompt_tokens):
            num_too_long += 1
            continue
        kept.append(problem)
        ids.append(prompt_ids)
    if num_too_long:
        logger.warning("%s: %d prompts empty or over max_prompt_tokens=%s; skipped", name, num_too_long,
                       config.max_prompt_tokens)
    started = time.monotonic()
    if isinstance(sampler, AgentSampler):
        samples = await sampler.sample_many(ids, config.n, config.sampling_params(), concurrency=config.concurrency)
    else:
        samples = await sample_all(sampler, ids, config.n, config.sampling_params(), concurrency=config.concurrency)
    sample_s = time.monotonic() - started
    errors = [s.error for group in samples for s in group if s.finish_reason == "error"]
    if errors and len(errors) == sum(len(g) for g in samples):
        # Every request rejected means a wrong setting (sampling field, context), not bad data.
        raise SamplingError(f"{name}: the server rejected all {len(errors)} requests; first: {errors[0]}")
    judged = None
    if judge is not None:
        flat = [s for group in samples for s in group]
        prompts = [tokenizer.decode(x, skip_special_tokens=True) for x, group in zip(ids, samples) for _ in group]
        answers = [p.answer for p, group in zip(kept, samples) for _ in group]
        judged = await judge.ascore(prompts, [s.text for s in flat], answers)
    records, metrics = evaluate_records(kept, samples, config.reward, dataset=name, judged=judged,
                                        drop_failed=judge is not None and judge.config.on_failure == "drop_group")
    metrics["num_prompts_skipped"] = float(num_too_long)
    metrics["sample_s"] = sample_s
    return records, metrics


async def run_evaluation(
    client: Any,
    tokenizer: Any,
    eval_config: EvalConfig,
    *,
    output_dir: Optional[Union[str, Path]] = None,
    step: Optional[int] = None,
    agent: Any = None,
    judge: Any = None,
) -> dict[str, float]:
    """Evaluate every dataset of `eval_config`; metrics as `eval/<dataset>/<metric>`. `judge`: the
    run's `rewards.judge.JudgeReward`, which grades when `eval.reward` is "judge" (ignored otherwise).

    `client` samples (a `RolloutClient`, or any object with `async generate(input_ids, sampling_params)`);
    run it on the client's event loop (`client.run(run_evaluation(client, ...))`).
    With `output_dir`, per-problem records go to `<output_dir>/<dataset>[.step<step>].jsonl`.
    Rows without prompt/answer are counted in `eval/<dataset>/num_rows_skipped`. With `agent` (the
    run's `rollout.agent.AgentLoop`) every response runs through the agent loop and its tools, and
    the metrics include `tool_call_rate`; `client` must then be a `RolloutClient`.
    """
    from megatron_bapo.rewards.judge_config import JUDGE

    if eval_config.reward == JUDGE and judge is None:
        raise ValueError("eval.reward=judge grades with the run's judge servers (reward.judge); pass the judge "
                         "(run_evaluation(judge=...)) or name a reward function")
    judge = judge if eval_config.reward == JUDGE else None
    sampler = AgentSampler(client, agent, tokenizer) if agent is not None else as_sampler(client)
    out: dict[str, float] = {}
    for ds in eval_config.datasets:
        problems, num_bad = load_problems(ds.path, max_problems=eval_config.max_problems)
        records, metrics = await evaluate_dataset(sampler, tokenizer, problems, eval_config, name=ds.name,
                                                  judge=judge)
        metrics["num_rows_skipped"] = float(num_bad)
        if output_dir is not None:
            suffix = f".step{step}" if step is not None else ""
            write_records(records, Path(output_dir) / f"{ds.name}{suffix}.jsonl")
        out.update({f"eval/{ds.name}/{k}": v for k, v in metrics.items()})
    return out


def datasets_from_paths(paths: Sequence[Union[str, Path]]) -> list[EvalDatasetConfig]:
    """One dataset per file, named by the file stem (`aime24.jsonl` -> `aime24`; repeats get `_2`, ...)."""
    out: list[EvalDatasetConfig] = []
    seen: dict[str, int] = {}
    for p in paths:
        stem = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in Path(p).stem) or "data"
        seen[stem] = seen.get(stem, 0) + 1
        out.append(EvalDatasetConfig(name=stem if seen[stem] == 1 else f"{stem}_{seen[stem]}", path=str(p)))
    return out


@contextlib.contextmanager
def _servers(model_path: str, urls: Sequence[str], server_kwargs: dict) -> Iterator[list[str]]:
    if urls:
        yield list(urls)
        return
    try:
        from megatron_bapo.server.launch import start_server
    except ImportError as exc:
        raise RuntimeError(f"no server URL given and the built-in server cannot be imported ({exc}); "
                           "pass --server-url") from exc

    logger.info("no --server-url given: starting the built-in server on loopback for %s", model_path)
    handle = start_server(model_path, **server_kwargs)
    try:
        yield [handle.url]
    finally:
        handle.stop()


def evaluate_checkpoint(
    model_path: Union[str, Path],
    config: EvalConfig,
    *,
    server_urls: Sequence[str] = (),
    output_dir: Optional[Union[str, Path]] = None,
    server_kwargs: Optional[dict] = None,
    agent: Any = None,
    judge: Any = None,
) -> dict[str, float]:
    """Evaluate an HF checkpoint directory on `config.datasets` (what `tools/evaluate.py` runs).

    Samples through `server_urls` (SGLang servers or a router serving this checkpoint) or, when
    none are given, a built-in server started on loopback and stopped afterwards. Writes
    `<output_dir>/<dataset>.jsonl` (per problem) and `<output_dir>/metrics.json`. With `agent` (a
    `rollout.agent.AgentConfig` with tools) responses run through the agent loop and its tools. With
    `judge` (a `rewards.judge.JudgeReward`) and `config.reward` "judge", the judge grades.
    """
    from transformers import AutoTokenizer

    if not config.datasets:
        raise ValueError("evaluate_checkpoint: config.datasets is empty; give at least one data file")
    from megatron_bapo.rollout import RolloutClient, RolloutClientConfig

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    with _servers(str(model_path), server_urls, dict(server_kwargs or {})) as urls:
        with RolloutClient(RolloutClientConfig(urls=list(urls), max_concurrency=config.concurrency)) as client:
            loop = None
            if agent is not None:
                from megatron_bapo.rollout.agent import AgentLoop

                loop = AgentLoop(agent, tokenizer)
            try:
                metrics = client.run(run_evaluation(client, tokenizer, config, output_dir=output_dir, agent=loop,
                                                    judge=judge))
            finally:
                if loop is not None:
                    loop.close()
    if output_dir is not None:
        summary = {"model_path": str(model_path), "server_urls": list(server_urls) or "built-in",
                   "config": dataclasses.asdict(config), "metrics": metrics}
        path = Path(output_dir) / "metrics.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """A small table: one row per dataset, one column per metric."""
    by_ds: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        _, ds, name = key.split("/", 2)
        by_ds.setdefault(ds, {})[name] = value
    cols = [c for c in next(iter(by_ds.values()), {}) if "@" in c] + ["num_problems", "num_answer_failures"]
    cols += [c for c in ("tool_call_rate",) if c in next(iter(by_ds.values()), {})]
    lines = ["dataset".ljust(16) + "".join(c.rjust(20) for c in cols)]
    for ds, values in by_ds.items():
        cells = "".join((f"{values[c]:.4f}" if "@" in c or c == "tool_call_rate" else f"{values[c]:.0f}").rjust(20)
                        for c in cols if c in values)
        lines.append(ds.ljust(16) + cells)
    return "\n".join(lines)
