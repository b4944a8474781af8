"""`reward.judge`: a model-graded reward's settings (what the judge reads, how its verdict becomes a number).

Selected by `reward.fn: judge` (training) and `eval.reward: judge` (evaluation); the scoring itself is
`rewards.judge.JudgeReward`. Kept apart from it so the run config can import this without the HTTP
client. Errors name the field and the fix, in one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bapo.config_io import ConfigError

JUDGE = "judge"
"""The reward name (`reward.fn`, `eval.reward`) that selects the judge."""

PLACEHOLDERS = ("prompt", "response", "answer")
"""What `template` may name, in braces: `{prompt}`, `{response}`, `{answer}`."""

ON_FAILURE = ("drop_group", "score_zero")

PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A `{name}` in `template`: one of `PLACEHOLDERS`, or refused as a misspelt one."""


@dataclass
class JudgeConfig:
    """A judge model served beside the policy reads each response and its generation is parsed into
    the reward (docs/rollout.md#judge-reward-rewardjudge)."""

    urls: list[str] = field(default_factory=list)
    """The judge servers (`http://host:port`, SGLang or the built-in server serving the judge model);
    `/generate` is balanced over them by a `RolloutClient` of their own, never weight-synced."""
    api_key: Optional[str] = None
    """The judge servers' API key (SGLang's `--api-key`), sent as a Bearer token; never written to the
    run directory. A `judge` section's servers use that section's `client.api_key` instead."""
    tokenizer: str = ""
    """HF directory (or hub name) of the judge's tokenizer, which builds its prompts and decodes its
    verdicts; empty: `model.hf_path` (the judge serves the policy's base model)."""
    template: str = ""
    """The judge's prompt. `{prompt}` (the policy's prompt as it saw it, chat template included,
    special tokens removed), `{response}` (the response, decoded as every reward sees it) and
    `{answer}` (the reference answer of the data row) are replaced literally; another `{name}` is
    refused as a misspelt placeholder, other braces (`\\frac{1}{2}`, JSON) are text. Sent as one user
    message through the judge tokenizer's chat template when it has one."""
    parse_regex: str = ""
    """A regular expression with one group: the group of its LAST match in the judge's generation is
    the verdict (a judge that reasons first states it last), a number, or a key of `values`."""
    values: dict[str, float] = field(default_factory=dict)
    """Verdict text -> reward (compared stripped and lower-cased), e.g. `{yes: 1, no: 0}`; empty: the
    group must be a number. Only with `parse_regex`."""
    parse_fn: str = ""
    """Instead of `parse_regex`: "package.module:function", `fn(text: str) -> float | None` (None:
    no verdict in the text). Runs in the driver's process; a call that raises counts as "judge_error"."""
    max_new_tokens: int = 64
    """Tokens the judge may generate per verdict."""
    temperature: float = 0.0
    """Sampling temperature of the judge (0: greedy)."""
    timeout_s: float = 120.0
    """Wall-clock limit of one verdict from when its request is sent, retries on another judge server
    included; past it the sample counts as "judge_timeout"."""
    max_concurrency: int = 64
    """Judge requests in flight at once (per scoring batch); the others wait without their clock running."""
    on_failure: str = "drop_group"
    """A verdict that timed out, failed or could not be parsed: "drop_group" (the sample's group is not
    trained, `judge/num_groups_dropped`; evaluation leaves its problem out of the means) or
    "score_zero" (the sample scores 0 and is trained). Either way it is counted by reason
    (`judge/num_timeout`, `judge/num_unparseable`, `judge/num_error`) and limited by
    `reward.max_failure_rate`."""

    def __post_init__(self) -> None:
        p = "reward.judge"
        self.urls = [str(u).rstrip("/") for u in self.urls]
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"{p}.urls: {u!r} must start with http:// or https://")
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"{p}.urls has duplicates: {self.urls}; list each judge server once")
        unknown = sorted({m for m in PLACEHOLDER_RE.findall(self.template)} - set(PLACEHOLDERS))
        if unknown:
            raise ConfigError(f"{p}.template names {{{unknown[0]}}}; the placeholders are "
                              f"{', '.join('{' + n + '}' for n in PLACEHOLDERS)}")
        if self.template and "{response}" not in self.template:
            raise ConfigError(f"{p}.template has no {{response}}: the judge would never see the response; add it")
        if self.parse_regex and self.parse_fn:
            raise ConfigError(f"{p}.parse_regex and {p}.parse_fn are both set; keep one parse rule")
        if self.parse_regex:
            try:
                groups = re.compile(self.parse_regex).groups
            except re.error as exc:
                raise ConfigError(f"{p}.parse_regex={self.parse_regex!r} is not a regular expression: {exc}") from None
            if groups != 1:
                raise ConfigError(f"{p}.parse_regex={self.parse_regex!r} has {groups} groups; it needs exactly one "
                                  f"(the verdict), e.g. '(?i)\\b(yes|no)\\b'; make the others (?:...)")
        if self.values and not self.parse_regex:
            raise ConfigError(f"{p}.values maps the text parse_regex captures; set {p}.parse_regex (a parse_fn "
                              f"returns the number itself)")
        values = {}
        for key, value in self.values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{p}.values[{key!r}]={value!r}: each value must be a finite number")
            values[str(key).strip().lower()] = float(value)
        self.values = values
        if self.parse_fn and ":" not in self.parse_fn:
            raise ConfigError(f"{p}.parse_fn={self.parse_fn!r}: expected an import path 'package.module:function'")
        for name in ("max_new_tokens", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{p}.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ConfigError(f"{p}.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not self.timeout_s > 0:
            raise ConfigError(f"{p}.timeout_s must be > 0, got {self.timeout_s}")
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"{p}.on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")

    def check_complete(self, used_by: str) -> None:
        """Refuse a judge that `used_by` ("reward.fn=judge", "eval.reward=judge") selects but that
        lacks a prompt or a parse rule."""
        if not self.template:
            raise ConfigError(f"{used_by} needs reward.judge.template, the judge's prompt with {{prompt}}, "
                              f"{{response}} and {{answer}}, e.g. 'Question: {{prompt}} Reference: {{answer}} "
                              f"Answer: {{response}} Is the answer correct? yes/no'")
        if not self.parse_regex and not self.parse_fn:
            raise ConfigError(f"{used_by} needs a parse rule: reward.judge.parse_regex (one group, e.g. "
                              f"'(?i)\\b(yes|no)\\b' with reward.judge.values {{yes: 1, no: 0}}) or "
                              f"reward.judge.parse_fn ('package.module:function')")


def check_judge_use(reward_fn: str, judge: JudgeConfig, eval_reward: Any, eval_on: bool) -> None:
    """The run's judge is complete where `reward.fn` or (evaluation on) `eval.reward` selects it."""
    if reward_fn == JUDGE:
        judge.check_complete("reward.fn=judge")
    if eval_on and eval_reward == JUDGE:
        judge.check_complete("eval.reward=judge")
