"""The progress watchdog: a run that stops updating the policy stops loudly, instead of exiting 0.

    watchdog = ProgressWatchdog(config.steps_without_update_limit())
    watchdog.observe(step, metrics)       # every step, every rank (metrics["train/updated"])

A step "updates" when the actor took at least one optimizer step that was not skipped. After
`trainer.max_steps_without_update` consecutive steps without one, `NoProgressError` says why, from
rank 0's metrics of the last steps: every token too stale to train, or stale samples regenerated
(servers reporting older weight versions than the trainer published), no group finished yet, groups filtered (uniform rewards) or failed
(4xx), replies refused, optimizer steps skipped (non-finite). Every rank sees the same updates (the
batch and the actor's skip decisions are the same everywhere), so every rank stops at the same step.
Why the derived default never fires on a healthy run: `RunConfig.steps_without_update_limit`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_REASONS_SHOWN = 3
_HINTS = (
    ("stale", "stale tokens are more than rollout.max_staleness versions older than the trainer's weights (and "
              "regenerated ones past rollout.max_group_staleness): do the servers serve the versions it publishes "
              "(their weight_version, their logs)?"),
    ("filtered", "filtered groups had uniform rewards: is the task too hard, or the reward constant?"),
    ("refused", "refused replies are named in the rollout client's warnings"),
)
"""What to look at, per reason shown."""


class NoProgressError(RuntimeError):
    """No optimizer update in `trainer.max_steps_without_update` consecutive steps; names why."""


def why_no_update(metrics: dict[str, float]) -> str:
    """The reasons a step made no update, read from its metrics (rank 0's; "" elsewhere)."""
    reasons = []
    if (n := int(metrics.get("staleness/num_masked_tokens", 0))) > 0 and metrics.get("staleness/frac_masked_tokens") == 1:
        reasons.append(f"all {n} token(s) too stale to train (rollout.max_staleness)")
    if (n := int(metrics.get("rollout/num_regenerated", 0))) > 0:
        reasons.append(f"{n} stale sample(s) regenerated")
    if (n := int(metrics.get("rollout/num_bad_replies", 0))) > 0:
        reasons.append(f"{n} reply(ies) refused")
    if (n := int(metrics.get("rollout/num_groups_failed", 0))) > 0:
        reasons.append(f"{n} group(s) failed (4xx)")
    if (n := int(metrics.get("judge/num_groups_dropped", 0))) > 0:
        reasons.append(f"{n} group(s) dropped for a missing judge verdict (reward.judge.on_failure)")
    groups = int(metrics.get("experience/num_groups", 0))
    filtered = int(metrics.get("experience/num_groups_filtered", 0))
    if "experience/num_groups" in metrics and groups == 0 and filtered:
        reasons.append(f"all {filtered} finished group(s) filtered (equal rewards, rollout.dynamic_sampling)")
    elif "experience/num_groups" in metrics and groups == 0:
        reasons.append(f"no group finished ({int(metrics.get('rollout/buffer_groups', 0))} still generating)")
    elif groups and not metrics.get("experience/num_samples"):
        reasons.append(f"{groups} finished group(s) but no usable sample")
    if metrics.get("actor/num_optimizer_steps"):
        reasons.append("every optimizer step skipped (non-finite loss, log-probs or advantages)")
    return ", ".join(reasons)


class ProgressWatchdog:
    """Counts consecutive steps without an optimizer update; raises at the limit (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stalled: list[tuple[int, str]] = []
        """(step, why) of the current run of steps without an update."""
        self.num_updated = 0
        self.num_steps = 0

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Record step `step` (`metrics["train/updated"]` 1 or 0); raise `NoProgressError` at the limit."""
        self.num_steps += 1
        if metrics.get("train/updated"):
            self.num_updated += 1
            self.stalled = []
            return
        self.stalled.append((step, why_no_update(metrics)))
        if self.limit and len(self.stalled) >= self.limit:
            shown = self.stalled[-_REASONS_SHOWN:][::-1]
            last = "; ".join(f"step {s}: {why or 'no update'}" for s, why in shown)
            hints = [hint for key, hint in _HINTS if any(key in why for _, why in shown)]
            raise NoProgressError(
                f"no optimizer update in {len(self.stalled)} consecutive steps ({self.stalled[0][0]}-{step}; "
                f"trainer.max_steps_without_update={self.limit}), so the run cannot learn: {last}. "
                + "".join(h + "; " for h in hints)
                + "raise trainer.max_steps_without_update (0: never stop) if this is expected")
