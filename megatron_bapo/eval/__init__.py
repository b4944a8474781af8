"""Evaluation: n samples per problem, avg@n / unbiased pass@k / majority vote, per dataset.

`evaluate_records` is the pure core; `run_evaluation` is the in-training hook (metrics under
`eval/<dataset>/...`); `evaluate_checkpoint` drives `tools/evaluate.py`.
"""

from megatron_bapo.eval.config import EvalConfig, EvalDatasetConfig
from megatron_bapo.eval.core import EvalProblem, Sample, evaluate_records, load_problems, read_records, write_records
from megatron_bapo.eval.metrics import majority_vote, pass_at_k, pass_k_values
from megatron_bapo.eval.runner import evaluate_checkpoint, prompt_to_ids, run_evaluation
from megatron_bapo.eval.sampling import ClientSampler, sample_all

__all__ = [
    "EvalConfig",
    "EvalDatasetConfig",
    "EvalProblem",
    "ClientSampler",
    "Sample",
    "evaluate_checkpoint",
    "evaluate_records",
    "load_problems",
    "majority_vote",
    "pass_at_k",
    "pass_k_values",
    "prompt_to_ids",
    "read_records",
    "run_evaluation",
    "sample_all",
    "write_records",
]
