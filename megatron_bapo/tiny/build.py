"""Build the tiny default's assets in one call: tokenizer + model, task data, SFT warm start.

`tools/make_tiny.py` is a thin CLI over `build_tiny_assets`. Layout of `out_dir`:

    base_model/        HF checkpoint after SFT (config, safetensors, tokenizer, chat template)
    data/train.jsonl   RL prompts {"prompt": "47+38=", "answer": "58", "a": 47, "b": 38}
    data/test.jsonl    held-out prompts (disjoint operand pairs)
    info.json          settings, the SFT curve, the measured base accuracy (greedy and sampled) and the
                       machine that built them (CPU kind, torch's CPU kernels: `run_record.machine_record`)

`TinyAssetsConfig.tools()` builds the tool task instead (`tiny.tool_task`: 3-digit multiplication,
a calculator call in a share of the SFT examples; base accuracy and tool-call rate measured through
an in-process agent loop; reward "arithmetic_final").

info.json is written last, so its presence means the directory is complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import time
from typing import Any, Callable, Optional

from megatron_bapo.run_record import machine_record
from megatron_bapo.tiny.checkpoint import build_tiny_model, save_quietly
from megatron_bapo.tiny.decode import answer_accuracy
from megatron_bapo.tiny.sft import SFTConfig, run_sft
from megatron_bapo.tiny.task import TaskConfig, generate_splits, write_jsonl
from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

logger = logging.getLogger(__name__)

TINY_DEFAULT_MODEL: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
)
"""The tiny default's policy: Qwen2, ~0.63M parameters (hidden 128, 4 layers, GQA 4/2, tied embeddings);
the size the calibration note measured learning reversed addition within a minute of SFT."""


@dataclasses.dataclass
class TinyAssetsConfig:
    """Everything `build_tiny_assets` needs; `seed` seeds the model init, the task splits and SFT."""

    seed: int = 0
    model: dict = dataclasses.field(default_factory=lambda: dict(TINY_DEFAULT_MODEL))
    """Overrides for `make_tiny_hf_checkpoint`/`build_tiny_model` (HF config fields, `architecture`)."""
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    num_base_eval: int = 500
    """Test problems for the base accuracy written to info.json (at most the test split size)."""

    @classmethod
    def tools(cls, seed: int = 0) -> "TinyAssetsConfig":
        """The tool task (module docstring): multiplication, 30% of the SFT examples call the calculator,
        no looping habit, a fixed 300 SFT steps (~15% sampled accuracy: the curve in `tiny.tool_task`;
        its old 15% target was crossed at step 300 by 0.005, so the step count hinged on the last bits)."""
        return cls(seed=seed, task=TaskConfig.tools(),
                   sft=SFTConfig(tool_fraction=0.3, loop_fraction=0.0, max_steps=300, target_accuracy=None,
                                 eval_every=100))

    @property
    def is_tool_task(self) -> bool:
        return self.sft.tool_fraction > 0


class OutputExistsError(FileExistsError):
    """The output directory is not empty and overwriting was not asked for."""


def build_tiny_assets(
    out_dir,
    config: Optional[TinyAssetsConfig] = None,
    *,
    force: bool = False,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> dict:
    """Write the tiny default's assets to `out_dir` (layout in the module docstring); returns info.json's dict.

    Refuses a non-empty `out_dir` unless `force` (then the directory is replaced). `on_step(step, loss)`
    is forwarded to the SFT loop (progress bars).
    """
    config = config or TinyAssetsConfig()
    out = pathlib.Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise OutputExistsError(f"{out} is not empty; pass force=True (--force) to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    task = dataclasses.replace(config.task, seed=config.seed)
    sft_config = dataclasses.replace(config.sft, seed=config.seed)
    train, test = generate_splits(task)
    write_jsonl(train, out / "data" / "train.jsonl")
    write_jsonl(test, out / "data" / "test.jsonl")

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=config.seed, **config.model)
    num_params = sum(p.numel() for p in model.parameters())
    evaluate = None
    if config.is_tool_task:
        from megatron_bapo.tiny.tool_task import agent_accuracy

        def evaluate(m, rows):  # sampled, as RL samples: the tool task's curve
            return agent_accuracy(m, tokenizer, rows, temperature=1.0, seed=sft_config.seed)
    result = run_sft(model, tokenizer, train, sft_config, on_step=on_step, evaluate=evaluate)

    eval_rows = test[: config.num_base_eval]
    base: dict[str, Any]
    if config.is_tool_task:
        greedy_m = agent_accuracy(model, tokenizer, eval_rows)
        sampled_m = agent_accuracy(model, tokenizer, eval_rows, temperature=1.0, seed=config.seed)
        greedy, sampled = greedy_m["accuracy"], sampled_m["accuracy"]
        base = {"greedy": greedy, "sampled_t1": sampled, "tool_call_rate_greedy": greedy_m["tool_call_rate"],
                "tool_call_rate_sampled_t1": sampled_m["tool_call_rate"]}
    else:
        greedy = answer_accuracy(model, tokenizer, eval_rows)
        sampled = answer_accuracy(model, tokenizer, eval_rows, temperature=1.0, seed=config.seed)
        base = {"greedy": greedy, "sampled_t1": sampled}
    save_quietly(model, out / "base_model")
    tokenizer.save_pretrained(out / "base_model")

    info = {
        "base_model": "base_model",
        "train_path": "data/train.jsonl",
        "test_path": "data/test.jsonl",
        "task": "tools" if config.is_tool_task else "addition",
        "reward": "arithmetic_final" if config.is_tool_task else "arithmetic",
        "num_parameters": num_params,
        "base_accuracy": {**base, "num_problems": len(eval_rows), "split": "test"},
        "sft": {"num_steps": result.num_steps, "stopped_because": result.stopped_because,
                "seconds": round(result.seconds, 2), "curve": result.curve},
        "seconds_total": round(time.perf_counter() - start, 2),
        "machine": machine_record(),
        "config": dataclasses.asdict(dataclasses.replace(config, task=task, sft=sft_config)),
    }
    tmp = out / "info.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "info.json")
    logger.info("tiny assets in %s: base greedy %.3f, sampled %.3f after %d SFT steps (%.0f s)",
                out, greedy, sampled, result.num_steps, info["seconds_total"])
    return info
