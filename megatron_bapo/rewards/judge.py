"""The judge reward: a judge model served beside the policy reads each response, and its generation,
parsed, is the reward (`reward.fn: judge`, `eval.reward: judge`; settings `reward.judge`,
`rewards.judge_config.JudgeConfig`).

    judge = JudgeReward.for_urls(cfg.reward.judge, urls, tokenizer)   # the URL list is all it needs
    results = judge.score(prompts, responses, answers)                # list[RewardResult], in order
    results = await judge.ascore(prompts, responses, answers)         # the same from a running loop

Per sample: the template is filled and tokenized with the judge's tokenizer (its chat template when
it has one), one `/generate` goes to the judge servers through a `RolloutClient` of their own (its
retries, its server choice and its checks of every reply), the generated ids are decoded with the
same tokenizer, and the parse rule (`parse_regex` + `values`, or `parse_fn`) turns the text into a
number. Every sample gets a `RewardResult` whose reason says what happened: "scored", or a failure
that scores 0 and is counted, never silent: "judge_timeout" (no verdict within `timeout_s`),
"judge_unparseable" (the text has no verdict the rule reads), "judge_error" (the servers rejected or
failed the request, or `parse_fn` raised). `reward.judge.on_failure` decides whether a failure's group
is dropped or its zero is trained (`experience.score_groups`, `eval.core.evaluate_records`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import Counter
from typing import Any, Callable, Optional, Sequence

from megatron_bapo.rewards.judge_config import JUDGE, JudgeConfig, PLACEHOLDER_RE
from megatron_bapo.rewards.types import RewardResult

logger = logging.getLogger(__name__)

SCORED, TIMEOUT, UNPARSEABLE, ERROR = "scored", "judge_timeout", "judge_unparseable", "judge_error"
JUDGE_FAILURES = (TIMEOUT, UNPARSEABLE, ERROR)
"""The reasons of a verdict the judge did not deliver (each also a failure of the reward function:
`reward.max_failure_rate` limits them, `rewards.types.REWARD_FN_FAILURES`)."""
METRIC = {SCORED: "judge/num_scored", TIMEOUT: "judge/num_timeout", UNPARSEABLE: "judge/num_unparseable",
          ERROR: "judge/num_error"}
"""Reason -> the step metric counting it."""


class JudgeReward:
    """Scores responses with the judge servers behind `client` (see the module docstring)."""

    def __init__(self, config: JudgeConfig, tokenizer: Any, client: Any, *, owns_client: bool = False) -> None:
        """`client`: a `RolloutClient` of the judge servers (`for_urls` builds one); closed by `close`
        when `owns_client`. `tokenizer`: the judge's (builds its prompts, decodes its verdicts)."""
        config.check_complete("the judge reward")
        self.config, self.tokenizer, self.client, self._owns_client = config, tokenizer, client, owns_client
        self._regex = re.compile(config.parse_regex) if config.parse_regex else None
        self._fn: Optional[Callable[[str], Any]] = None
        if config.parse_fn:
            from megatron_bapo.rewards import RewardSpecError, import_callable

            self._fn = import_callable(config.parse_fn, config.parse_fn, kind="reward.judge.parse_fn", builtins=(),
                                       error=RewardSpecError)
        self._chat = getattr(tokenizer, "chat_template", None) is not None

    @classmethod
    def for_urls(cls, config: JudgeConfig, urls: Sequence[str], tokenizer: Any, *,
                 api_key: Optional[str] = None) -> "JudgeReward":
        """A judge over the servers at `urls` (its own client: never weight-synced, no version checks).
        The one place the judge's servers enter: today `reward.judge.urls`, later a judge pool's."""
        from megatron_bapo.rollout.client import RolloutClient
        from megatron_bapo.rollout.config import RolloutClientConfig

        if not urls:
            raise ValueError("the judge reward needs its servers' URLs: set reward.judge.urls")
        # An attempt's own limit lies past the verdict's deadline: two timers cancelling one task can lose
        # one cancellation (aiohttp turns its own into a TimeoutError the client retries).
        client = RolloutClient(RolloutClientConfig(urls=list(urls), max_concurrency=config.max_concurrency,
                                                   request_timeout_s=2 * config.timeout_s,
                                                   api_key=api_key or config.api_key))
        return cls(config, tokenizer, client, owns_client=True)

    def close(self) -> None:
        """Stop the client `for_urls` made (a client passed in belongs to its caller)."""
        if self._owns_client:
            self.client.close()

    # ------------------------------------------------------------------ one verdict
    def prompt_ids(self, prompt: str, response: str, answer: str) -> list[int]:
        """The judge's input: the filled template, as one user message through the judge's chat
        template (with the generation prompt) when its tokenizer has one, else as it is."""
        values = {"prompt": prompt, "response": response, "answer": answer}
        text = PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], self.config.template)  # one pass: inserted text stays
        if self._chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def parse(self, text: str) -> RewardResult:
        """The verdict in the judge's generation `text`, as a `RewardResult` ("scored", or
        "judge_unparseable" / "judge_error" scoring 0)."""
        if self._fn is not None:
            try:
                value = self._fn(text)
            except Exception as exc:  # a plugin bug is counted like a failed request, not raised
                return _failed(ERROR, f"reward.judge.parse_fn raised {type(exc).__name__}: {exc}")
            if value is None:
                return _failed(UNPARSEABLE, f"parse_fn found no verdict in {text[:200]!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return _failed(ERROR, f"reward.judge.parse_fn returned {value!r}, not a finite number or None")
            return RewardResult(float(value), SCORED)
        matches = [m.group(1) for m in self._regex.finditer(text)]
        verdict = matches[-1] if matches and matches[-1] is not None else None
        if verdict is None:
            return _failed(UNPARSEABLE, f"no match of reward.judge.parse_regex in {text[:200]!r}")
        key = verdict.strip().lower()
        if self.config.values:
            if key not in self.config.values:
                return _failed(UNPARSEABLE, f"verdict {verdict!r} is not a key of reward.judge.values")
            return RewardResult(self.config.values[key], SCORED)
        try:
            value = float(key)
        except ValueError:
            return _failed(UNPARSEABLE, f"verdict {verdict!r} is not a number (set reward.judge.values)")
        if not math.isfinite(value):
            return _failed(UNPARSEABLE, f"verdict {verdict!r} is not a finite number")
        return RewardResult(value, SCORED)

    async def _one(self, ids: list[int], slots: asyncio.Semaphore) -> RewardResult:
        from megatron_bapo.rollout.errors import RolloutError

        params = {"max_new_tokens": self.config.max_new_tokens, "temperature": self.config.temperature}
        async with slots:  # the clock starts when the request goes out, not while it waits its turn
            request = asyncio.ensure_future(self.client.agenerate(ids, params))
            done, _ = await asyncio.wait({request}, timeout=self.config.timeout_s)
            if not done:  # the deadline decides, whatever the cancelled request does with its cancellation
                request.cancel()
                return _failed(TIMEOUT, f"no verdict within reward.judge.timeout_s={self.config.timeout_s}")
            try:
                reply = request.result()
            except RolloutError as exc:  # rejected (4xx), or every retry failed
                return _failed(ERROR, str(exc))
        if reply.finish_type not in ("stop", "length"):
            return _failed(ERROR, f"the judge server ended the request with {reply.finish_type!r}")
        return self.parse(self.tokenizer.decode(reply.output_ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ a batch
    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[RewardResult]:
        """The verdicts on `responses[i]` (to `prompts[i]`, reference `answers[i]`), in order; at most
        `max_concurrency` requests in flight; never raises for a sample. From a plain thread."""
        return self.client.run(self._gather(prompts, responses, answers))

    async def ascore(self, prompts: Sequence[str], responses: Sequence[str],
                     answers: Sequence[str]) -> list[RewardResult]:
        """`score` from a running event loop (evaluation's): the requests run on the judge client's own
        loop, so the caller's loop stays free and no session of the judge is left on it."""
        coro = self._gather(prompts, responses, answers)
        if asyncio.get_running_loop() is self.client.loop:
            return await coro
        return await asyncio.wrap_future(self.client.submit(coro))

    async def _gather(self, prompts: Sequence[str], responses: Sequence[str],
                      answers: Sequence[str]) -> list[RewardResult]:
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(f"judge: {len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
        slots = asyncio.Semaphore(self.config.max_concurrency)  # per call: a semaphore belongs to one loop
        ids = [self.prompt_ids(p, r, a) for p, r, a in zip(prompts, responses, answers)]
        return list(await asyncio.gather(*(self._one(x, slots) for x in ids)))


def _failed(reason: str, error: str) -> RewardResult:
    return RewardResult(0.0, reason, None, failed=True, error=error[:500])


def judge_counts(results: Sequence[RewardResult]) -> dict[str, int]:
    """Counts by reason of judge results (every reason present, 0 included)."""
    counts = Counter(r.reason for r in results)
    return {reason: counts.get(reason, 0) for reason in METRIC}


def lost_groups(results: Sequence[RewardResult], group_ids: Sequence[str]) -> set[str]:
    """The ids of the groups with a verdict the judge did not deliver (`results[i]` is a sample of
    group `group_ids[i]`): what `on_failure: drop_group` drops."""
    return {g for r, g in zip(results, group_ids) if r.reason in JUDGE_FAILURES}


def log_step(step: int, metrics: dict[str, float], on_failure: str) -> Optional[str]:
    """Log a step's judge counts by reason in one line (a warning when a verdict is missing, so it
    reaches the console); returns the line (None when the step asked the judge nothing)."""
    if METRIC[SCORED] not in metrics:
        return None
    counts = ", ".join(f"{int(metrics.get(METRIC[r], 0))} {r.removeprefix('judge_')}" for r in METRIC)
    dropped = int(metrics.get("judge/num_groups_dropped", 0))
    line = f"judge: step {step}: {counts}; {dropped} group(s) dropped (reward.judge.on_failure={on_failure})"
    missing = sum(int(metrics.get(METRIC[r], 0)) for r in JUDGE_FAILURES)
    logger.log(logging.WARNING if missing else logging.INFO, line)
    return line


def start_judge(reward: Any, eval_cfg: Any, *, urls: Sequence[str], model_path: str,
                api_key: Optional[str] = None) -> Optional[JudgeReward]:
    """The run's judge when `reward.fn` or (evaluation on) `eval.reward` is "judge", else None: over
    the servers at `urls` (today `reward.judge.urls`; the one input a pool of judge servers would
    replace), with `reward.judge.tokenizer` or else `model_path`'s (`open_judge`)."""
    evaluates = eval_cfg.reward == JUDGE and eval_cfg.every_n_steps > 0 and bool(eval_cfg.datasets)
    if reward.fn != JUDGE and not evaluates:
        return None
    return open_judge(reward.judge, urls, tokenizer_path=reward.judge.tokenizer or model_path, api_key=api_key)


def open_judge(config: JudgeConfig, urls: Sequence[str], *, tokenizer_path: str,
               api_key: Optional[str] = None) -> JudgeReward:
    """A judge over the servers at `urls` with the tokenizer at `tokenizer_path`; a missing URL list
    or tokenizer is a `ConfigError` naming the field."""
    from transformers import AutoTokenizer

    from megatron_bapo.config_io import ConfigError

    if not urls:
        raise ConfigError("reward.judge.urls is empty: list the judge servers (http://host:port) that serve the "
                          "judge model (reward.fn=judge or eval.reward=judge), or give a `judge` section "
                          "(judge.model_path) and the run starts them")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"reward.judge.tokenizer: cannot load a tokenizer from {tokenizer_path!r} ({exc}); set it "
                          f"to the judge model's HF directory") from None
    return JudgeReward.for_urls(config, urls, tokenizer, api_key=api_key)
