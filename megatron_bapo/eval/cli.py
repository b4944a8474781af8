"""`tools/evaluate.py`: sample n responses per problem from an HF checkpoint and report avg@n,
pass@k and maj@n per dataset.

    python tools/evaluate.py --model-path HF_DIR --data aime24.jsonl [--data aime25.parquet]
        [--n 16] [--temperature 0.6] [--top-p 0.95] [--max-new-tokens N]
        [--server-url URL ...] [--reward math] [--output DIR] [--agent-config RUN_CONFIG.yaml]
        [--judge-config RUN_CONFIG.yaml]

Without --server-url the built-in CPU server is started on 127.0.0.1 for the checkpoint. With
--agent-config every response runs through the agent loop with the tools of that run config's
`rollout.agent` section (e.g. examples/configs/tiny_tools.yaml), and the tool-call rate is reported.
With --judge-config a judge model grades (`--reward judge`): the `reward.judge` section of that run
config (its servers, prompt template, parse rule; docs/rollout.md#judge-reward-rewardjudge).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from megatron_bapo.eval.config import EvalConfig
from megatron_bapo.eval.runner import datasets_from_paths, evaluate_checkpoint, format_metrics


def _agent_config(path: str):
    """The `rollout.agent` section of a run config file (validated; its tool specs imported)."""
    import yaml

    from megatron_bapo.config_io import from_dict
    from megatron_bapo.rollout.agent import AgentConfig
    from megatron_bapo.rollout.tools import load_tool_fn

    data = yaml.safe_load(open(path, encoding="utf-8")) or {}
    agent = from_dict(AgentConfig, ((data.get("rollout") or {}).get("agent")) or {}, "rollout.agent")
    if not agent.enabled:
        raise ValueError(f"--agent-config {path}: rollout.agent.tools is empty")
    for tool in agent.tools:
        load_tool_fn(tool.fn)
    return agent


def _judge_config(path: str):
    """The `reward.judge` section of a run config file (validated, complete)."""
    import yaml

    from megatron_bapo.config_io import from_dict
    from megatron_bapo.rewards.judge_config import JudgeConfig

    data = yaml.safe_load(open(path, encoding="utf-8")) or {}
    judge = from_dict(JudgeConfig, ((data.get("reward") or {}).get("judge")) or {}, "reward.judge")
    judge.check_complete(f"--judge-config {path}")
    return judge


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    d = EvalConfig()
    p.add_argument("--model-path", required=True, help="HF checkpoint dir (tokenizer; model for the built-in server)")
    p.add_argument("--data", required=True, action="append", help="jsonl/parquet eval set; repeat for several")
    p.add_argument("--n", type=int, default=d.n, help="samples per problem")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--server-url", nargs="+", action="extend", default=[], help="SGLang server or router URL(s)")
    p.add_argument("--reward", default=d.reward, help="built-in name or package.module:function")
    p.add_argument("--output", default=None, help="dir for <dataset>.jsonl per-problem records and metrics.json")
    p.add_argument("--max-problems", type=int, default=None, help="evaluate only the first N problems per file")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    p.add_argument("--agent-config", default=None,
                   help="a run config whose rollout.agent section (tools, turns, call format) the responses use")
    p.add_argument("--judge-config", default=None,
                   help="a run config whose reward.judge section (judge servers, template, parse rule) grades")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    judge = None
    try:
        config = EvalConfig(
            datasets=datasets_from_paths(args.data), n=args.n, temperature=args.temperature, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, reward="judge" if args.judge_config else args.reward,
            max_problems=args.max_problems, concurrency=args.concurrency,
        )
        from megatron_bapo.rewards import load_reward_fn

        if args.judge_config:
            from megatron_bapo.rewards.judge import open_judge

            judge_cfg = _judge_config(args.judge_config)
            judge = open_judge(judge_cfg, judge_cfg.urls, tokenizer_path=judge_cfg.tokenizer or args.model_path)
        else:
            load_reward_fn(config.reward)  # fail before starting servers on a bad spec
        agent = _agent_config(args.agent_config) if args.agent_config else None
    except ValueError as exc:
        print(f"evaluate.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        metrics = evaluate_checkpoint(args.model_path, config, server_urls=args.server_url, output_dir=args.output,
                                      agent=agent, judge=judge)
    finally:
        if judge is not None:
            judge.close()
    print(format_metrics(metrics))
    return 0
