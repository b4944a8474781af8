"""Short supervised warm start on the arithmetic task, so the RL run starts from a policy with signal.

The warm start also gives the base policy a habit RL has to remove, the one that makes reasoning
models' failures long: on `loop_fraction` of its examples the answer is not followed by EOS but
repeated ("58=58=58=58") up to the response limit, as a model stuck in a re-checking loop does.
A looped response scores 0 (the arithmetic reward takes the whole first word, "58=58=58=58"), so
failing responses are longer than successful ones, and GRPO's per-group zero-sum advantages then
give negative tokens most of the weight: the imbalance BAPO's adaptive bounds correct (paper §3).

Plain torch + transformers on CPU: cross-entropy on the answer tokens and EOS only (prompt tokens are
masked), AdamW at a constant learning rate after a short warmup. Every `eval_every` steps the greedy
accuracy on a fixed validation set is measured (the curve, in info.json), and training stops at the
first step whose accuracy reaches `target_accuracy`: a base at roughly 30-45% greedy accuracy leaves
RL room to improve.

Why a target and not a fixed step count: the curve is a phase transition. Accuracy sits near 10% for
hundreds of steps, then rises to 95% within ~150 (measured, 2-core Xeon, seed 0: 0.19 at step 950,
0.49 at 1000, 0.79 at 1050, 0.97 at 1125), and where it rises depends on floating-point noise: matmul
and reduction kernels differ by CPU instruction set. On the same Xeon the same seeds reached 40% at
step 992 with torch's AVX512 kernels, 930 with its AVX2 ones (0.67 against 0.41 test accuracy at step
1000) and 653 with its scalar ones (ATEN_CPU_CAPABILITY=default); an AMD EPYC crossed 30% ~200 steps
before the Xeon. A fixed step count in the rise gives any accuracy from 10% to 95%; before or after
it, the base has no signal or no room. So the stop pins the quality instead: a check every
`eval_every` steps, and when one reaches the target, the steps since the previous check run again
from a copy of its state with a check after each, so the stop lands on the first step at or over the
target (validation accuracy 0.405, 0.430 and 0.400 at the three builds' stops; the old rule, the
first 25-step check over 30%, stopped the AMD and Xeon builds at 0.335 and 0.485). The weights
differ by CPU kind; their accuracy hardly does (test split: 0.408, 0.392, 0.390).
`target_accuracy=None` trains `max_steps` steps (the tool task: a fixed 300).

The tool task (`tiny.tool_task`) shows a calculator call on `tool_fraction` of the examples (the
tool's result tokens masked from the loss, as in RL) and a direct answer on the rest; its curve
measures the accuracy of sampled responses through an in-process agent loop instead (`evaluate`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from typing import Callable, Optional, Sequence

import torch

from megatron_bapo.tiny.decode import answer_accuracy

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclasses.dataclass
class SFTConfig:
    """Warm-start settings (defaults measured on 2 shared CPU cores, see the tiny report)."""

    max_steps: int = 1500
    """Upper bound on optimizer steps (all of them when `target_accuracy` is None or not reached)."""
    target_accuracy: Optional[float] = 0.4
    """Stop at the first step whose validation accuracy is >= this (module docstring: checked every
    `eval_every` steps, then step by step since the previous check); None: run `max_steps` steps."""
    min_steps: int = 0
    """Do not stop before this many steps."""
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    eval_every: int = 25
    num_eval: int = 200
    """Validation problems for the curve and the stop (taken from the training rows)."""
    seed: int = 0
    loop_fraction: float = 0.35
    """Share of examples whose answer is repeated with "=" to `loop_tokens` tokens instead of ending
    with EOS (the base's looping habit, see the module docstring); 0 = none."""
    loop_tokens: int = 12
    """Length of a looped response in tokens (the RL run's rollout.max_response_tokens)."""
    tool_fraction: float = 0.0
    """Share of examples that demonstrate a calculator call (`tiny.tool_task`) instead of answering
    directly; 0 = none (the default task)."""

    def validate(self) -> None:
        if not 0.0 <= self.loop_fraction < 1.0:
            raise ValueError(f"sft.loop_fraction must be in [0, 1), got {self.loop_fraction}")
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"sft.tool_fraction must be in [0, 1], got {self.tool_fraction}")
        if self.tool_fraction and self.loop_fraction:
            raise ValueError("sft.tool_fraction and sft.loop_fraction cannot both be set (one habit per task)")
        for name in ("max_steps", "loop_tokens", "batch_size", "eval_every", "num_eval"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"sft.lr must be > 0, got {self.lr}")
        if self.target_accuracy is not None and self.target_accuracy <= 0:
            raise ValueError(f"sft.target_accuracy must be > 0 (or None: no early stop), got {self.target_accuracy}")
        if self.min_steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"sft.min_steps and sft.warmup_steps must be >= 0, got {self.min_steps}, {self.warmup_steps}")


@dataclasses.dataclass
class SFTResult:
    """What the warm start did: the measured curve and why it stopped."""

    num_steps: int
    stopped_because: str
    """"max_steps" (ran them all) or "target_reached" (`target_accuracy` stopped it early)."""
    curve: list[dict]
    """One entry per evaluation: {"step", "loss" (mean since the previous eval), "greedy_accuracy", "seconds"}
    (the tool task: what its `evaluate` returns, "accuracy" and "tool_call_rate", instead of "greedy_accuracy")."""
    losses: list[float]
    """Training loss of every step."""
    seconds: float


def looped_answer(answer: str, num_tokens: int) -> str:
    """The answer repeated with "=" and cut to `num_tokens` characters (one token each): "58=58=58=58"."""
    return "=".join([answer] * (num_tokens // (len(answer) + 1) + 1))[:num_tokens]


def make_sft_batch(tokenizer, rows: Sequence[dict], looped: Optional[Sequence[bool]] = None,
                   loop_tokens: int = 12, tool_demo: Optional[Sequence[bool]] = None) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (response tokens only) for prompt/answer
    rows; the response is answer + EOS, or for `looped[i]` the looped answer (no EOS), or for
    `tool_demo[i]` a calculator call, its result (not labelled: a tool wrote it) and the answer."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs, labels = [], []
    for i, row in enumerate(rows):
        prompt_ids = tokenizer.encode(row["prompt"])
        if tool_demo is not None and tool_demo[i]:
            from megatron_bapo.tiny.tool_task import demo_ids

            answer_ids, model_wrote = demo_ids(tokenizer, row)
            seqs.append(prompt_ids + answer_ids)
            labels.append([IGNORE_INDEX] * len(prompt_ids) + [t if m else IGNORE_INDEX for t, m in zip(answer_ids, model_wrote)])
            continue
        if looped is not None and looped[i]:
            answer_ids = tokenizer.encode(looped_answer(row["answer"], loop_tokens))
        else:
            answer_ids = tokenizer.encode(row["answer"]) + [eos]
        seqs.append(prompt_ids + answer_ids)
        labels.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    label_t = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        input_ids[i, : len(s)] = torch.tensor(s)
        label_t[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": label_t}


def run_sft(
    model: torch.nn.Module,
    tokenizer,
    train_rows: Sequence[dict],
    config: Optional[SFTConfig] = None,
    *,
    on_step: Optional[Callable[[int, float], None]] = None,
    evaluate: Optional[Callable[[torch.nn.Module, list[dict]], dict]] = None,
) -> SFTResult:
    """Train `model` in place on `train_rows` to `target_accuracy` (or for `max_steps`); returns the curve.

    The target stops at the first step at or over it, not the first check: when a check reaches it,
    the model, optimizer and data order go back to the previous check and its steps run again with a
    check after each (module docstring: the stop then overshoots by one step's rise, not up to
    `eval_every` steps', which on the steep part of the curve was 0.2). The curve keeps every check
    of the final trajectory. `on_step(step, loss)` is called once per step number (progress bars).
    `evaluate(model, rows) -> {"accuracy": ..., ...}` replaces the greedy accuracy as the curve's
    measure (the tool task). Deterministic for a given seed, model and row list (single-threaded math aside).
    """
    config = config or SFTConfig()
    config.validate()
    if len(train_rows) < 2:
        raise ValueError(f"run_sft needs at least 2 training rows, got {len(train_rows)}")
    rng = random.Random(config.seed)
    eval_rows = rng.sample(list(train_rows), min(config.num_eval, len(train_rows)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    target = config.target_accuracy
    curve: list[dict] = []
    losses: list[float] = []
    start = time.perf_counter()
    stopped_because = "max_steps"
    model.train()
    step, furthest, replaying = 0, 0, False
    checkpoint = _snapshot(model, optimizer, scheduler, rng, step) if target is not None else None
    while step < config.max_steps:
        step += 1
        losses.append(_train_step(model, optimizer, scheduler, tokenizer, rng.choices(train_rows, k=config.batch_size),
                                  rng, config))
        if on_step is not None and step > furthest:
            on_step(step, losses[-1])
        furthest = max(furthest, step)
        if not (replaying or step % config.eval_every == 0 or step == config.max_steps):
            continue
        measured = ({"greedy_accuracy": answer_accuracy(model, tokenizer, eval_rows)} if evaluate is None
                    else evaluate(model, eval_rows))
        accuracy = measured["greedy_accuracy" if evaluate is None else "accuracy"]
        reached = target is not None and accuracy >= target and step >= config.min_steps
        if reached and not replaying and checkpoint is not None and step - checkpoint["step"] > 1:
            logger.info("sft step %d: accuracy %.3f >= target %.3f; replaying steps %d-%d with a check after each",
                        step, accuracy, target, checkpoint["step"] + 1, step)
            step = _restore(checkpoint, model, optimizer, scheduler, rng)
            del losses[step:]
            replaying = True
            continue
        recent = losses[-(1 if replaying else config.eval_every):]
        curve.append({"step": step, "loss": sum(recent) / len(recent), **measured,
                      "seconds": round(time.perf_counter() - start, 2)})
        logger.info("sft step %d: loss %.4f, %s", step, curve[-1]["loss"],
                    ", ".join(f"{k} {v:.3f}" for k, v in measured.items()))
        if reached:
            stopped_because = "target_reached"
            break
        if target is not None and not replaying:
            checkpoint = _snapshot(model, optimizer, scheduler, rng, step)
    model.eval()
    return SFTResult(num_steps=step, stopped_because=stopped_because, curve=curve, losses=losses,
                     seconds=time.perf_counter() - start)


def _train_step(model: torch.nn.Module, optimizer, scheduler, tokenizer, rows: list[dict], rng: random.Random,
                config: SFTConfig) -> float:
    """One optimizer step on `rows` (looped / tool-demo examples drawn from `rng`); returns its loss."""
    looped = [rng.random() < config.loop_fraction for _ in rows] if config.loop_fraction else None
    tool_demo = [rng.random() < config.tool_fraction for _ in rows] if config.tool_fraction else None
    batch = make_sft_batch(tokenizer, rows, looped, config.loop_tokens, tool_demo)
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()


def _snapshot(model: torch.nn.Module, optimizer, scheduler, rng: random.Random, step: int) -> dict:
    """Everything the next steps depend on, copied: weights, optimizer and schedule state, data order."""
    return {"step": step, "model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(optimizer.state_dict()), "scheduler": copy.deepcopy(scheduler.state_dict()),
            "rng": rng.getstate()}


def _restore(snapshot: dict, model: torch.nn.Module, optimizer, scheduler, rng: random.Random) -> int:
    """Back to `snapshot` (see `_snapshot`); returns its step."""
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
    scheduler.load_state_dict(snapshot["scheduler"])
    rng.setstate(snapshot["rng"])
    return snapshot["step"]
