"""A stronger tiny model to distill from: the quick start's base with a longer SFT.

    build_tiny_teacher("runs/tiny_assets")    # writes runs/tiny_assets/teacher_model, info.json "teacher"
    python tools/make_tiny.py --out runs/tiny_assets --teacher    # the same from the CLI

The teacher starts from `base_model` (the quick start's SFT warm start, ~40% greedy accuracy, with its
looping habit: `tiny.sft`) and continues the same SFT, on the same training rows and tokenizer (the
student's: `teacher.model_path` requires it), without the looped examples, until its greedy
validation accuracy reaches `target_accuracy` (0.8 by default; the reversed-addition curve rises
from 0.4 to 0.95 within ~150 steps once it has started: `tiny.sft`) or `max_steps`. Measured on the
2-core Xeon (AVX512 kernels) from the default assets: 54 steps, 6 s; test accuracy 0.850 greedy, 0.670
sampled (the base: 0.408, 0.200 on the same 500 problems). So the teacher
answers and stops where the base loops: on-policy distillation has both the habit and the accuracy
to teach (`examples/configs/tiny_distill.yaml`). Its greedy and sampled test accuracies go to
info.json next to the base's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import time
from typing import Any, Callable, Optional

from megatron_bapo.tiny.build import OutputExistsError
from megatron_bapo.tiny.decode import answer_accuracy
from megatron_bapo.tiny.sft import SFTConfig, run_sft
from megatron_bapo.tiny.task import read_jsonl

logger = logging.getLogger(__name__)

TEACHER_DIR = "teacher_model"


@dataclasses.dataclass
class TeacherConfig:
    """How `build_tiny_teacher` continues the base's SFT."""

    target_accuracy: Optional[float] = 0.8
    """Stop at the first step with this greedy validation accuracy (as `SFTConfig.target_accuracy`);
    None: run all `max_steps`."""
    max_steps: int = 600
    """Most SFT steps on top of the base's."""
    loop_fraction: float = 0.0
    """Share of looped examples (the base's habit, `SFTConfig.loop_fraction`): none, so the teacher stops."""
    num_eval: Optional[int] = None
    """Problems each evaluation decodes (validation curve and test accuracies); None: the base's (its SFT's
    validation problems, and the test problems of its base accuracy, so the two compare)."""


def build_tiny_teacher(assets_dir, config: Optional[TeacherConfig] = None, *, force: bool = False,
                       on_step: Optional[Callable[[int, float], None]] = None) -> dict:
    """Write `<assets_dir>/teacher_model` from the complete tiny assets in `assets_dir` (their
    `base_model`, training rows and SFT settings) and record it in info.json under "teacher"; returns
    that record. Refuses an existing teacher unless `force`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_bapo.tiny.checkpoint import save_quietly

    config = config or TeacherConfig()
    root = pathlib.Path(assets_dir)
    info_path = root / "info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{root} has no info.json: build the tiny assets first "
                                f"(tools/make_tiny.py --out {root})")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    if info.get("task") != "addition":
        raise ValueError(f"{root}: a teacher is built for the addition task, these assets are {info.get('task')!r}")
    out = root / TEACHER_DIR
    if out.exists():
        if not force:
            raise OutputExistsError(f"{out} exists; pass force=True (--force) to rebuild the teacher")
        shutil.rmtree(out)
    start = time.perf_counter()
    base_sft = info["config"]["sft"]
    num_val = config.num_eval or int(base_sft["num_eval"])
    num_test = config.num_eval or int(info["base_accuracy"]["num_problems"])
    sft = dataclasses.replace(SFTConfig(**base_sft), target_accuracy=config.target_accuracy, seed=base_sft["seed"] + 1,
                              max_steps=config.max_steps, loop_fraction=config.loop_fraction, num_eval=num_val)
    tokenizer = AutoTokenizer.from_pretrained(root / info["base_model"])
    model = AutoModelForCausalLM.from_pretrained(root / info["base_model"])
    result = run_sft(model, tokenizer, read_jsonl(root / info["train_path"]), sft, on_step=on_step)
    test = read_jsonl(root / info["test_path"])[:num_test]
    greedy = answer_accuracy(model, tokenizer, test)
    sampled = answer_accuracy(model, tokenizer, test, temperature=1.0, seed=sft.seed)
    save_quietly(model, out)
    tokenizer.save_pretrained(out)
    record: dict[str, Any] = {
        "model": TEACHER_DIR,
        "accuracy": {"greedy": greedy, "sampled_t1": sampled, "num_problems": len(test), "split": "test"},
        "sft": {"num_steps": result.num_steps, "stopped_because": result.stopped_because,
                "seconds": round(result.seconds, 2), "curve": result.curve, "from": info["base_model"]},
        "config": dataclasses.asdict(config),
        "seconds_total": round(time.perf_counter() - start, 2),
    }
    info["teacher"] = record
    tmp = root / "info.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    tmp.replace(info_path)
    logger.info("tiny teacher in %s: greedy %.3f, sampled %.3f after %d more SFT steps (%.0f s)", out, greedy, sampled,
                result.num_steps, record["seconds_total"])
    return record
