"""A checkpoint's rollout state as flat arrays in a file of the checkpoint (`rollout.state_tokens`),
written and read where the buffers live: with `trainer.driver_process` no per-token list crosses the
pipe, in either direction, and the buffer comes back exactly (ids, log-probs bit for bit, versions,
states, routing). Real files, a real driver process with a stand-in server on loopback."""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import yaml

from megatron_bapo import run_state
from megatron_bapo.rollout.types import (NO_VERSION, AgentState, Prompt, RolloutGroup, RolloutRound, Sample,
                                         SampleState)

MAX_LIST = 10_000


def _bits(values) -> list[int]:
    return [struct.unpack("<Q", struct.pack("<d", v))[0] for v in values]


def _groups(logprob=lambda i, j: -((7 * i + j) % 97) / 8.0) -> list[RolloutGroup]:
    """Edge cases: an empty response, tool tokens (log-prob 0.0, NO_VERSION), routing bytes, -0.0 and
    -inf log-probs, a token id past int32 (that field goes int64), a finished sample with a reward."""
    samples = [
        Sample(prompt_ids=[5, 6, 7]),
        Sample(prompt_ids=[5, 6, 7], response_ids=list(range(300)),
               response_logprobs=[logprob(1, j) for j in range(300)], response_versions=[3] * 100 + [4] * 200,
               state=SampleState.PARTIAL, num_segments=2, routed_experts=bytes(range(256)) * 3, routed_width=2),
        Sample(prompt_ids=[5, 6, 7], response_ids=[9, 10, 2**40], response_logprobs=[-0.0, -math.inf, -1.5],
               response_versions=[2, 2, 3], state=SampleState.COMPLETED, reward=1.0,
               finish_reason={"type": "stop", "matched": 1}),
    ]
    samples[1].append_tool_tokens([11, 12, 13])
    samples[1].agent.pending = [{"name": "calc", "arguments": {"x": 1}}]
    return [RolloutGroup(group_id="a", prompt=Prompt(prompt_ids=[5, 6, 7], answer="7", index=4, metadata={"k": [1]}),
                         samples=samples, start_version=2),
            RolloutGroup(group_id="b", prompt=Prompt(prompt_ids=[8], index=5),
                         samples=[Sample(prompt_ids=[8], response_ids=[1] * 20, response_logprobs=[-0.5] * 20,
                                         response_versions=[NO_VERSION] * 20, state=SampleState.ABORTED,
                                         agent=AgentState(tool_spans=[[0, 20]])),
                                  Sample(prompt_ids=[8]),
                                  Sample(prompt_ids=[8], state=SampleState.FAILED, error="400")],
                         start_version=3)]


def _state(groups: list[RolloutGroup]) -> dict:
    """A driver state as `Driver.state_dict` takes it: the buffer, a round produced ahead, the sampler's step."""
    ahead = RolloutRound(prompts=[g.prompt for g in groups], groups=groups[:1], dropped=groups[1:], metrics={"m": 1.0})
    return {"step": 4, "version": 4, "data": {"format": 1, "position": 3},
            "rollout": {"format": 1, "groups": [g.to_dict() for g in groups], "totals": {"num_segments": 9}},
            "rounds": {"ready": [ahead.to_dict()]},
            "sampling": {"step": {"drawn": [groups[0].prompt.to_dict()], "kept": [groups[1].to_dict()], "dropped": [],
                                  "refill_prompts": [5], "first_round_done": True}, "carried": 1}}


@pytest.mark.parametrize("logprobs", ["float32_exact", "float64"])
def test_the_buffer_round_trips_exactly_through_the_token_file(tmp_path, logprobs):
    """Saved and loaded (through JSON, as trainer.json holds the tree): every group, round and step
    equal to the original, log-probs bit for bit, whether they fit float32 exactly (SGLang's) or not."""
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TokenFile, save_tokens

    lp = (lambda i, j: -((7 * i + j) % 97) / 8.0) if logprobs == "float32_exact" else (lambda i, j: -0.1 * (j + 1))
    groups = _groups(lp)
    state = _state(groups)
    before = json.dumps(state)
    small = save_tokens(state, tmp_path)
    assert json.dumps(state) == before, "save_tokens changed the state it was given"
    assert not any(isinstance(v, list) and len(v) > 20 for v in _leaves(small)), "a token list stayed in the tree"

    tokens = TokenFile.open(json.loads(json.dumps(small)), tmp_path)
    dtypes = {field: dtype.str for field, (dtype, _, _) in tokens.layout.items()}
    assert dtypes["response_logprobs"] == ("<f4" if logprobs == "float32_exact" else "<f8")
    assert dtypes["response_ids"] == "<i8" and dtypes["response_versions"] == "<i4"
    back = tokens.load()
    restored = [RolloutGroup.from_dict(g) for g in back["rollout"]["groups"]]
    assert [g.to_dict() for g in restored] == [g.to_dict() for g in groups]
    for got, want in zip((s for g in restored for s in g.samples), (s for g in groups for s in g.samples)):
        assert _bits(got.response_logprobs) == _bits(want.response_logprobs)
        assert got.routed_experts == want.routed_experts and got.agent == want.agent
    assert RolloutRound.from_dict(back["rounds"]["ready"][0]).to_dict() == state["rounds"]["ready"][0]
    assert [RolloutGroup.from_dict(g).to_dict() for g in back["sampling"]["step"]["kept"]] == \
        state["sampling"]["step"]["kept"]
    assert Prompt.from_dict(back["sampling"]["step"]["drawn"][0]) == groups[0].prompt
    assert {k: back[k] for k in ("step", "data")} == {k: state[k] for k in ("step", "data")}
    assert (tmp_path / TOKENS_FILE).is_file() and not list(tmp_path.glob("*.tmp"))


def _leaves(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _leaves(v)
    elif isinstance(node, list):
        yield node
        for v in node:
            yield from _leaves(v)


def test_a_damaged_token_file_is_skipped_like_any_damaged_file(tmp_path, caplog):
    """The token file lies in the checkpoint directory, so the manifest covers it: bytes changed on
    disk make `latest_checkpoint` skip that checkpoint for the previous one; a descriptor that does not
    fit the file is refused by name."""
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TokenFile, save_tokens

    state = _state(_groups())
    for step in (2, 4):
        ckpt = run_state.checkpoint_dir(tmp_path, step)
        run_state.save_trainer_state(ckpt, save_tokens(state, ckpt))
    newest = run_state.checkpoint_dir(tmp_path, 4)
    assert TOKENS_FILE in json.loads((newest / run_state.MANIFEST).read_text())["files"]
    data = bytearray((newest / TOKENS_FILE).read_bytes())
    data[100] ^= 0xFF
    (newest / TOKENS_FILE).write_bytes(bytes(data))
    assert run_state.latest_checkpoint(tmp_path) == run_state.checkpoint_dir(tmp_path, 2)
    assert any(TOKENS_FILE in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)

    (newest / TOKENS_FILE).write_bytes(bytes(data[:200]))
    with pytest.raises(ValueError, match=TOKENS_FILE):
        TokenFile.open(run_state.load_trainer_state(newest), newest)


def test_a_state_written_before_the_token_file_still_loads(tmp_path):
    """A checkpoint of b74de61 (the lists in trainer.json and its binary side file) loads as before."""
    from megatron_bapo.rollout.state_tokens import TokenFile

    groups = _groups()
    run_state.save_trainer_state(tmp_path, _state(groups))
    state = run_state.load_trainer_state(tmp_path)
    assert TokenFile.open(state, tmp_path) is None
    assert [RolloutGroup.from_dict(g).to_dict() for g in state["rollout"]["groups"]] == [g.to_dict() for g in groups]


def test_a_save_killed_while_the_driver_writes_its_token_file_is_skipped(tmp_path, caplog):
    """The driver writes the token file on a thread after `state_dict` returns, and rank 0 writes the
    manifest only once it has the file's entry (`Driver.state_files`). A process killed in between
    leaves trainer.json next to a part file (or none) and no manifest: `latest_checkpoint` skips that
    step for the previous one. Completed, the entry the writer hashed from memory is the file's sha256,
    and that checkpoint verifies (the token file hashed once, by its writer)."""
    from megatron_bapo.manifest import hash_file, hash_own_files
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, snapshot

    state = _state(_groups())
    older, newest = run_state.checkpoint_dir(tmp_path, 2), run_state.checkpoint_dir(tmp_path, 4)
    for ckpt in (older, newest):
        snap = snapshot(state)
        ckpt.mkdir(parents=True)  # as the actor's save leaves it
        run_state.write_trainer_state(ckpt, snap.tree)
        if ckpt == newest:  # killed while writing: the part file as the writer leaves it, no manifest
            (ckpt / (TOKENS_FILE + ".tmp")).write_bytes(snap.arrays()["response_ids"].tobytes()[:64])
            break
        own = hash_own_files(ckpt, 0, 1, skip=frozenset({TOKENS_FILE}))
        assert TOKENS_FILE not in own
        written = snap.start(ckpt).result()
        assert written == {TOKENS_FILE: hash_file(ckpt / TOKENS_FILE)}
        run_state.finish_checkpoint(ckpt, {**own, **written})
    assert run_state.latest_checkpoint(tmp_path) == older
    assert any(str(newest) in r.getMessage() and "incomplete" in r.getMessage() for r in caplog.records)
    assert run_state.verify_checkpoint(older) is None


# ---------------------------------------------------------------------- through a real driver process
class _ListSizes(pickle._Pickler):
    """Pickles as the pipe does and records the length of every list it serializes."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.sizes: list[int] = []

    def save_list(self, obj: list) -> None:
        self.sizes.append(len(obj))
        pickle._Pickler.save_list(self, obj)

    dispatch[list] = save_list


CROSSED: dict[str, list[int]] = {}
PHASE = ["setup"]


def _record(obj) -> None:
    pickler = _ListSizes()
    pickler.dump(obj)
    CROSSED.setdefault(PHASE[0], []).extend(pickler.sizes)


class _RecordingPickler(ForkingPickler):
    """`multiprocessing.connection`'s pickler on rank 0's side of the pipe: every message sent, and
    every reply received (the objects the driver process pickled), goes through `_record`."""

    @classmethod
    def dumps(cls, obj, protocol=None):
        _record(obj)
        return super().dumps(obj, protocol)

    @staticmethod
    def loads(data, *args, **kwargs):
        obj = pickle.loads(data, *args, **kwargs)
        _record(obj)
        return obj


RESPONSE_TOKENS = 12_000  # one segment per sample, > MAX_LIST


def _config(tiny_hf_dir: Path, root: Path, url: str, out: Path):
    from megatron_bapo.config import load_run_config

    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                              for a in range(10, 20)))
    cfg = {"model": {"hf_path": str(tiny_hf_dir)},
           "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
           "trainer": {"output_dir": str(out), "async_steps": 1, "progress": False},
           "reward": {"fn": "arithmetic", "num_workers": 0},
           "rollout": {"group_size": 2, "prompts_per_step": 1, "max_response_tokens": 2 * RESPONSE_TOKENS,
                       "segment_tokens": RESPONSE_TOKENS, "sampling": {"ignore_eos": True},
                       "client": {"urls": [url], "health_timeout_s": 60}}}
    path = root / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_run_config(path)


@pytest.fixture(scope="module")
def through_the_driver_process(tiny_hf_dir, tmp_path_factory):
    """A driver process samples one round ahead (two responses of RESPONSE_TOKENS tokens), is
    checkpointed and closed; a second one resumes from that checkpoint and is checkpointed again.
    Returns (first checkpoint, its state, the second's checkpoint, its state, list sizes per call)."""
    from transformers import AutoConfig

    import multiprocessing.connection as connection

    from fake_server import ThreadedFakeServer
    from megatron_bapo.driver_process import DriverProcess

    root = tmp_path_factory.mktemp("driver_process")
    hf_config = AutoConfig.from_pretrained(tiny_hf_dir)
    real = connection._ForkingPickler
    connection._ForkingPickler = _RecordingPickler
    CROSSED.clear()
    try:
        with ThreadedFakeServer() as server:
            first = DriverProcess(_config(tiny_hf_dir, root, server.url, root / "first"), root / "first")
            try:
                first.start({}, step=0, version=0, hf_config=hf_config, world_size=1)
                first.start_rollout()
                deadline = time.monotonic() + 120
                while server.server.num_generate < 2 or server.server.running:  # the round's two segments ran
                    assert time.monotonic() < deadline, "the driver process sampled nothing"
                    time.sleep(0.05)
                ckpt = run_state.checkpoint_dir(root / "first", 2)
                ckpt.mkdir(parents=True)  # as the actor's save leaves it before the trainer asks the driver
                PHASE[0] = "state_dict"
                saved = first.state_dict(2, 0, wait=False)  # as the trainer: the file written on a thread
                written = first.state_files(), first.state_files()  # asked again (an interrupted call): the same
                PHASE[0] = "setup"
            finally:
                first.close()
            run_state.save_trainer_state(ckpt, saved)
            second = DriverProcess(_config(tiny_hf_dir, root, server.url, root / "second"), root / "second")
            try:
                PHASE[0] = "start"
                second.start(run_state.load_trainer_state(ckpt), step=2, version=0, hf_config=hf_config, world_size=1,
                             checkpoint=ckpt)
                PHASE[0] = "setup"
                again = second.state_dict(2, 0)
            finally:
                second.close()
    finally:
        connection._ForkingPickler = real
    return ckpt, saved, run_state.checkpoint_dir(root / "second", 2), again, dict(CROSSED), written


def test_no_per_token_list_crosses_the_driver_process_pipe(through_the_driver_process):
    """Checkpointing a driver process whose buffer holds responses of 12,000 tokens, and resuming one
    from it: no list of more than 10^4 elements is pickled across its pipe (b74de61 pickled every
    response's ids, log-probs and versions: 0.28 us a value, ~100 s per save and resume at 32B)."""
    *_, crossed, _ = through_the_driver_process
    longest = {call: max(crossed.get(call) or [-1]) for call in ("state_dict", "start")}
    assert min(longest.values()) >= 0, f"nothing crossed the pipe during a call: {longest}"
    assert max(longest.values()) <= MAX_LIST, f"the longest list pickled across the pipe, per call: {longest}"


def test_a_resumed_driver_process_saves_the_buffer_it_was_given(through_the_driver_process):
    """The second driver process, resumed from the first's checkpoint, checkpoints the same state
    (its run record names its own directory): the same tree and the same token file, byte for byte
    (ids, log-probs bit for bit, versions, states), holding both responses of the round sampled ahead."""
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TokenFile

    ckpt, saved, ckpt_again, again, _, _ = through_the_driver_process
    assert {k: v for k, v in again.items() if k != "run"} == {k: v for k, v in saved.items() if k != "run"}
    assert (ckpt_again / TOKENS_FILE).read_bytes() == (ckpt / TOKENS_FILE).read_bytes()
    state = TokenFile.open(saved, ckpt).load()
    samples = [Sample.from_dict(s) for g in state["rollout"]["groups"] for s in g["samples"]]
    assert [len(s.response_ids) for s in samples] == [RESPONSE_TOKENS] * 2
    assert all(s.state is SampleState.PARTIAL and set(s.response_versions) == {0} for s in samples)
    assert len(state["rounds"]["ready"]) == 1  # the round produced ahead, handed over first on resume


def test_the_driver_process_hands_over_the_manifest_entry_of_the_file_it_wrote(through_the_driver_process):
    """`state_dict(wait=False)` then `state_files()` through the pipe: the entry (size, sha256) the
    driver process hashed while writing is the file's, so rank 0 never reads the file back to hash it;
    asked again (the trainer's exit path after a call SIGTERM interrupted), the same entry."""
    from megatron_bapo.manifest import hash_file
    from megatron_bapo.rollout.state_tokens import TOKENS_FILE

    ckpt, *_, (written, again) = through_the_driver_process
    assert written == again == {TOKENS_FILE: hash_file(ckpt / TOKENS_FILE)}


def test_a_driver_process_that_closed_leaves_no_empty_stacks_file(through_the_driver_process):
    """The file the child's threads' stacks go to when it stops answering is removed at a normal close
    while empty (it was left, empty, in every run's logs/)."""
    from megatron_bapo.driver_process import STACKS_FILE

    ckpt, _, ckpt_again, *_ = through_the_driver_process
    for out in (ckpt.parents[1], ckpt_again.parents[1]):
        logs = out / "logs"
        assert logs.is_dir() and not (logs / STACKS_FILE).exists(), sorted(p.name for p in logs.iterdir())
