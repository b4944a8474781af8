"""The run's sample ledger, `samples.jsonl` (rank 0, written by the driver)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


class SampleLedger:
    """`samples.jsonl`: per step, the prompts drawn, the groups trained and the groups dropped (equal
    rewards under `rollout.dynamic_sampling`, or no teacher log-probs: `rollout.teacher`) (rank 0).

    Lets a user (and the kill-and-resume test) check that no prompt is lost or trained twice across
    restarts: a resumed run first drops the killed run's lines after its checkpoint. With rollout
    ahead of training, a round's prompts are recorded when the step that trains it takes it.
    """

    def __init__(self, path: Path, resume_step: Optional[int]) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text(encoding="utf-8").splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        elif resume_step is None and path.exists():
            path.unlink()

    def record(self, step: int, prompts: list[Any], groups: list[Any], dropped: list[Any] = ()) -> None:
        line = {"step": step, "drawn": [p.index for p in prompts],
                "trained": [[g.group_id, g.prompt.index] for g in groups],
                "dropped": [[g.group_id, g.prompt.index] for g in dropped]}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
