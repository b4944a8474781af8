"""Memory and layout planner for the Megatron actor (what `tools/plan.py` prints).

Answers "does this parallel layout fit on these GPUs at this sequence length?" before a job is
submitted: the model is built on the meta device from its HF config (no weights), parameters are
counted per rank from megatron-core's own tensor-parallel attributes, and activations, logits and
log-prob chunks are estimated from the shapes the actor will run.
"""

from megatron_bapo.planner.inputs import PlanInputs, PlanError, inputs_from_run_yaml
from megatron_bapo.planner.layout import validate_layout
from megatron_bapo.planner.memory import MemoryPlan, StageMemory, format_plan, plan_memory
from megatron_bapo.planner.params import ParamCounts, count_parameters

__all__ = [
    "PlanInputs",
    "PlanError",
    "inputs_from_run_yaml",
    "validate_layout",
    "MemoryPlan",
    "StageMemory",
    "plan_memory",
    "format_plan",
    "ParamCounts",
    "count_parameters",
]
