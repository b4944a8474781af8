"""A checkpoint's snapshot of the rollout state reads no token value under the producer's pause, yet
the file written afterwards holds exactly the state at the pause, whatever the rollout appended or
reset since (`rollout.state_tokens`). Real lists, real files; the lists notice when their values are
read (`rollout_state_helpers.GatedList`)."""

from __future__ import annotations

import copy
import json

import numpy as np

from megatron_bapo.rollout.types import RolloutGroup, RolloutRound, Sample, live_lists
from rollout_state_helpers import GatedList, gated_groups, grow_and_reset


def _state(groups: list[RolloutGroup]) -> dict:
    """A driver state as `Driver.state_dict` takes it: the buffer, a round produced ahead."""
    ahead = RolloutRound(prompts=[g.prompt for g in groups], groups=groups[:1], dropped=groups[1:])
    return {"step": 4, "version": 4, "data": {"format": 1, "position": 3},
            "rollout": {"format": 1, "groups": [g.to_dict() for g in groups], "totals": {}},
            "rounds": {"ready": [ahead.to_dict()]}}


def test_the_snapshot_reads_no_value_and_the_file_holds_the_state_at_the_pause(tmp_path):
    """Under the pause (armed: a value read on this thread fails) the snapshot takes the live lists;
    then segments extend them, a tool appends, a routing grows and a sample is reset; then the writer
    reads the values on its thread. Loaded back, the state equals a deep copy taken at the pause (835d065
    read every value under the pause: 34-45 ns each, ~14 s at the recipe's 3e8)."""
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TokenFile, snapshot

    groups = gated_groups()
    at_pause = copy.deepcopy(_state(groups))
    GatedList.opened.clear()
    GatedList.armed, GatedList.reads_under_pause = True, 0
    try:
        with live_lists():
            snap = snapshot(_state(groups))
    finally:
        GatedList.armed = False
    assert GatedList.reads_under_pause == 0
    grow_and_reset(groups)
    assert _state(groups) != at_pause, "the rollout's changes after the pause changed nothing"
    GatedList.opened.set()
    entry = snap.start(tmp_path).result()
    assert set(entry) == {TOKENS_FILE} and not list(tmp_path.glob("*.tmp"))

    back = TokenFile.open(json.loads(json.dumps(snap.tree)), tmp_path).load()
    assert [RolloutGroup.from_dict(g).to_dict() for g in back["rollout"]["groups"]] == at_pause["rollout"]["groups"]
    assert RolloutRound.from_dict(back["rounds"]["ready"][0]).to_dict() == at_pause["rounds"]["ready"][0]
    restored = Sample.from_dict(back["rollout"]["groups"][0]["samples"][0])
    assert restored.routed_experts == bytes(range(200)) * 2 and len(restored.response_ids) == 3000


def test_a_token_file_of_format_1_still_loads(tmp_path):
    """Checkpoints written since the token file existed and before its header (format 1, 835d065: the
    arrays' dtypes and offsets in the tree) load as they did."""
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TOKENS_KEY, TokenFile, snapshot

    groups = gated_groups(tokens=50)
    GatedList.opened.set()
    state = _state(groups)
    snap = snapshot(state)
    arrays, tree = snap.arrays(), snap.tree
    layout, offset, blob = {}, 0, b""
    for field, arr in arrays.items():  # format 1: the arrays back to back from offset 0, 64-aligned
        pad = -offset % 64
        blob += b"\0" * pad + arr.tobytes()
        layout[field] = [arr.dtype.str, offset + pad, len(arr)]
        offset += pad + arr.nbytes
    (tmp_path / TOKENS_FILE).write_bytes(blob)
    tree[TOKENS_KEY] = {"format": 1, "file": TOKENS_FILE, "arrays": layout}
    back = TokenFile.open(json.loads(json.dumps(tree)), tmp_path).load()
    assert [RolloutGroup.from_dict(g).to_dict() for g in back["rollout"]["groups"]] == state["rollout"]["groups"]
    assert isinstance(back["rollout"]["groups"][0]["samples"][0]["response_ids"], np.ndarray)
