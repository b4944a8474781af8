"""Group sampling with partial rollout (design section 3, step 3; spec section 14).

Each `step(prompts, version)` call (a round; `astep` on the client's loop) returns a `RolloutRound`:
1. opens a group of G pending samples per new prompt (appended to the buffer);
2. for every unfinished sample in the buffer, sends ONE segment: `input_ids = prompt + response so
   far`, `max_new_tokens = min(segment_tokens, max_response_tokens - generated)`. A response keeps
   its tokens and their versions across segments and syncs, whatever their age: staleness is judged
   per token when the group is trained (`max_staleness`, the driver masks older tokens out of the
   loss). Only a buffered group holding a token more than the hard cap `group_staleness_cap`
   versions behind `version` (in an unfinished sample, or in a finished one waiting for its
   siblings) is reset and regenerated from scratch, all its samples together (counted, in samples
   and tokens). Before sending, the client's concurrency is sized to what the servers' KV holds for
   requests of this run (`client.afit_concurrency`, `rollout.concurrency`). A round cut by a sync's
   "abort" pause before any group finished goes on after continue (its samples continue on the new
   weights) until one does, so a sync never hands the trainer an empty round; one with a finished
   group ends at the pause (the trainer waits for no tail);
3. records each segment's tokens with their behavior log-probs and versions (and, with
   `return_routed_experts`, the MoE routing of the positions it computed first: the request asks
   from `routed_experts_start_len` = the rows recorded so far, so every position keeps the routing of
   the forward that first computed it, and rows stay contiguous from the prompt's first token), and
   sets the state:
   stop -> completed; length at max_response_tokens (or clipped by the context) -> truncated;
   length below it -> partial; abort -> aborted (kept, resumed next step); 4xx -> failed;
4. returns the groups whose G samples are all finished, oldest first, with the round's metrics and
   rejections; the rest stay buffered.
Groups with a failed sample are dropped and counted (GRPO needs whole groups). A round cut short
by a pause leaves the samples it did not reach as they were; `ready_for_prompts` tells the producer
not to open new groups while older ones wait unstarted, so the buffer stays bounded.

A segment whose request failed on every server leaves its sample as it was (nothing lost) and the
step raises RolloutError after recording the segments that did succeed. `state_dict()` is
JSON-safe and restores the buffer exactly.

Multi-turn samples (`agent`, a `rollout.agent.AgentLoop`): a sample's round is then the agent loop's
`advance` instead of one segment: model turns and tool calls alternate within the round's token
budget (`segment_tokens` of sampled tokens), each request through `_Turn` (the same seeds, routing,
version labels and finish states as a single-turn segment). Staleness counts sampled tokens only.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence

from megatron_bapo.rollout.client import RolloutClient
from megatron_bapo.rollout.config import PartialRolloutConfig
from megatron_bapo.rollout.errors import ProtocolError, RequestRejected, RolloutError
from megatron_bapo.rollout.types import GenerateResult, Prompt, RolloutGroup, RolloutRound, Sample, SampleState

if TYPE_CHECKING:
    from megatron_bapo.rollout.agent import AgentLoop

logger = logging.getLogger(__name__)
STATE_FORMAT = 1
_COUNTERS = ("num_groups_started", "num_groups_finished", "num_groups_failed", "num_segments",
             "num_regenerated", "num_regenerated_tokens", "num_aborted_segments", "num_tokens_generated",
             "num_bad_replies", "num_passes_after_pause")


class PartialRolloutManager:
    """Owns the partial-rollout buffer; the trainer calls `step` once per RL step."""

    def __init__(self, client: RolloutClient, config: PartialRolloutConfig, *, seed: Optional[int] = None,
                 agent: Optional["AgentLoop"] = None) -> None:
        """`seed`: when set, every segment request carries its own `sampling_seed`, derived from
        (seed, the group's prompt index and start version, the sample's index in the group, the
        tokens it has so far, its regenerations), so a run samples the same responses whatever
        order its requests reach the servers in, and a resumed run samples as the uninterrupted one
        would. Set it only for servers that honour seeds (SGLang: `--enable-deterministic-inference`;
        the driver passes it when `rollout.deterministic_inference`). None: the servers' own generators.
        `agent`: run multi-turn, tool-calling samples (module docstring); None: one segment per round."""
        self.client = client
        self.config = config
        self.seed = seed
        self.agent = agent
        self.counters = _COUNTERS + (agent.COUNTERS if agent is not None else ())
        self.buffer: list[RolloutGroup] = []
        self.totals: dict[str, int] = {k: 0 for k in self.counters}
        """Counters since the run started (checkpointed); each round's own are in its metrics."""
        self._warned_version = False

    # ------------------------------------------------------------------ stepping
    def step(self, prompts: Sequence[Prompt], version: int, *, only_aborted: bool = False) -> RolloutRound:
        """Sync `astep` on the client's background loop."""
        return self.client.run(self.astep(prompts, version, only_aborted=only_aborted))

    async def astep(self, prompts: Sequence[Prompt], version: int, *, only_aborted: bool = False) -> RolloutRound:
        """Start groups for `prompts`, advance every buffered sample by one segment, return the round:
        the groups that are now complete (all G samples completed or truncated), oldest first, its
        metrics and the servers' rejections.

        `version` is the policy version the servers are serving now (int); it is used for the
        staleness cap and for tokens whose reply carried no integer weight_version. `only_aborted`:
        advance only the samples an abort cut (state ABORTED): the rest of a round a checkpoint's
        abort ended (`DynamicSampler`), so that round hands over what it would have without the cut.
        """
        started = time.monotonic()
        step = {k: 0 for k in self.counters}
        bad_replies = self.client.stats.get("num_bad_replies", 0)
        for p in prompts:
            if not p.prompt_ids:
                raise ValueError(f"prompt {p.index} has no token ids")
            g = self.config.group_size
            self.buffer.append(RolloutGroup(group_id=uuid.uuid4().hex, prompt=p, start_version=int(version),
                                            samples=[Sample(prompt_ids=list(p.prompt_ids)) for _ in range(g)]))
        step["num_groups_started"] = len(prompts)
        await self._fit_concurrency()

        errors: list[BaseException] = []
        rejections: list[str] = []
        for _ in range(self.config.num_segments + 1):  # a group needs at most num_segments segments
            cuts = self.client.stats.get("num_abort_pauses", 0)
            await self._advance_buffer(version, step, errors, rejections, only_aborted)
            # A sync's "abort" pause ends the round at once when it has a group to train; when it
            # cut the round before any group finished, the round goes on (its samples continue on the
            # new weights after continue, the segments the pause kept them from sent now) until one
            # does: a round handed over empty would cost the trainer a step with no update.
            if (errors or self.client.stats.get("num_abort_pauses", 0) == cuts
                    or any(g.finished and not g.failed for g in self.buffer)):
                break
            step["num_passes_after_pause"] += 1

        if rejections:  # one line per step, not one per request
            logger.warning("%d rollout request(s) rejected (4xx), their groups dropped; first: %s",
                           len(rejections), rejections[0])
        finished, failed, kept = [], [], []
        for group in self.buffer:
            (failed if group.failed else finished if group.finished else kept).append(group)
        # On error the finished groups stay buffered too: the next step returns them, none is lost.
        self.buffer = [g for g in self.buffer if not g.failed] if errors else kept
        if errors:
            finished = []
        step["num_groups_finished"], step["num_groups_failed"] = len(finished), len(failed)
        # Replies refused by the client's checks (and retried) while this step ran.
        step["num_bad_replies"] = self.client.stats.get("num_bad_replies", 0) - bad_replies
        for k, v in step.items():
            self.totals[k] += v
        metrics = self._metrics(step, finished, time.monotonic() - started)
        if errors:
            if any(isinstance(e, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)) for e in errors):
                raise errors[0]
            first = str(errors[0]) if isinstance(errors[0], RolloutError) else repr(errors[0])
            raise RolloutError(f"{len(errors)} rollout segment(s) failed on every server; every group stays "
                               f"buffered for the next step: {first}") from errors[0]
        return RolloutRound(prompts=list(prompts), groups=finished, metrics=metrics, rejections=rejections)

    async def _advance_buffer(self, version: int, step: dict[str, int], errors: list[BaseException],
                              rejections: list[str], only_aborted: bool = False) -> None:
        """One segment (or agent round) for every unfinished sample of the buffer (groups past the
        hard cap reset first)."""
        jobs: list[tuple[RolloutGroup, int, Sample]] = []
        for group in self.buffer:
            # The hard cap covers finished samples waiting for their siblings too, and the whole group
            # restarts together, so its samples stay in step (they would otherwise reset each other).
            if any(s.state is not SampleState.FAILED and self._too_stale(s, version) for s in group.samples):
                for s in group.samples:
                    if s.state is not SampleState.FAILED and s.response_ids:
                        step["num_regenerated_tokens"] += len(s.model_versions)  # sampled tokens only
                        s.reset()
                        s.num_regenerations += 1
                        step["num_regenerated"] += 1
            for j, s in enumerate(group.samples):
                if not s.state.resumable or (only_aborted and s.state is not SampleState.ABORTED):
                    continue
                if self._budget(s) <= 0:
                    s.state = SampleState.TRUNCATED
                    continue
                jobs.append((group, j, s))

        results = await asyncio.gather(*(self._advance(g, j, s, version, step) for g, j, s in jobs),
                                       return_exceptions=True)
        for (_, _, s), res in zip(jobs, results):
            if isinstance(res, RequestRejected):
                s.state, s.error = SampleState.FAILED, str(res)
                rejections.append(str(res))
            elif isinstance(res, BaseException):
                errors.append(res)  # the sample keeps what it had recorded and is resumed next step

    async def _advance(self, group: RolloutGroup, index: int, s: Sample, version: int, step: dict[str, int]) -> None:
        """The sample's work of this round: one segment, or the agent loop's turns and tool calls."""
        if self.agent is not None:
            await self.agent.advance(s, _Turn(self, group, index, s, version, step), self.config.segment_budget, step)
            return
        res = await self._segment(s, self._request_seed(group, index, s))
        self._apply(s, res, version, step)

    def _too_stale(self, s: Sample, version: int) -> bool:
        cap = self.config.group_staleness_cap
        versions = s.model_versions  # a tool's tokens have no version
        return cap is not None and bool(versions) and int(version) - min(versions) > cap

    def _room(self, s: Sample) -> int:
        """Tokens the sample may still add (response and context limits; tool results count)."""
        room = self.config.max_response_tokens - len(s.response_ids)
        if self.config.max_context_tokens is not None:
            room = min(room, self.config.max_context_tokens - len(s.prompt_ids) - len(s.response_ids))
        return room

    async def _fit_concurrency(self) -> None:
        """Size the client's concurrency for this run's requests (the longest prompt buffered); a
        server that cannot be asked now leaves it as it was (its requests fail over as usual)."""
        longest = max((len(g.prompt.prompt_ids) for g in self.buffer), default=0)
        try:
            await self.client.afit_concurrency(self.config.kv_tokens_per_request(longest))
        except RolloutError as exc:
            logger.debug("rollout concurrency not sized this round: %s", exc)

    def ready_for_prompts(self) -> bool:
        """Whether a round should open new groups: not while a buffered group waits unstarted (a
        round cut short by a pause did not reach it), so the buffer cannot grow without bound."""
        return not any(not g.failed and not any(s.response_ids for s in g.samples) for g in self.buffer)

    def _budget(self, s: Sample) -> int:
        """max_new_tokens of the sample's next segment (<= 0: no room left, it is truncated)."""
        return min(self.config.segment_budget, self._room(s))

    def _request_seed(self, group: RolloutGroup, index: int, s: Sample) -> Optional[int]:
        """The segment's `sampling_seed`, or None for the server's generator (see __init__)."""
        if self.seed is None:
            return None
        key = f"{self.seed}:{group.prompt.index}:{group.start_version}:{index}:{len(s.response_ids)}:{s.num_regenerations}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1

    async def _segment(self, s: Sample, seed: Optional[int] = None, max_new_tokens: Optional[int] = None) -> GenerateResult:
        params = {**self.config.sampling.to_params(), "max_new_tokens": max_new_tokens or self._budget(s)}
        if self.agent is not None:
            params = self.agent.request_params(params)
        if seed is not None:
            params["sampling_seed"] = seed
        if not self.config.return_routed_experts:
            return await self.client.agenerate(s.prompt_ids + s.response_ids, params)
        start = s.routed_rows
        res = await self.client.agenerate(s.prompt_ids + s.response_ids, params, routed_experts_start_len=start)
        expected = len(s.prompt_ids) + len(s.response_ids) + len(res.output_ids) - 1 - start
        if res.routed_experts is None and expected > 0 and res.output_ids:
            raise RolloutError(f"server {res.url} returned no meta_info.routed_experts for a request with "
                               f"return_routed_experts (rollout.return_routed_experts=true): launch the servers "
                               f"with --enable-return-routed-experts")
        return res

    def _apply(self, s: Sample, res: GenerateResult, version: int, step: dict[str, int],
               requested: Optional[int] = None) -> None:
        requested = requested or self._budget(s)
        if any(v is None for v in res.versions) and not self._warned_version:
            logger.warning("server %s reports a non-integer weight_version; tokens are labelled with the "
                           "trainer's version %d (call update_weights_from_disk with an int version first)",
                           res.url, version)
            self._warned_version = True
        if self.config.return_routed_experts and res.routed_experts is not None:
            _append_routing(s, res)
        s.response_ids.extend(res.output_ids)
        s.response_logprobs.extend(res.logprobs)
        s.response_versions.extend(int(version) if v is None else v for v in res.versions)
        s.finish_reason = res.finish_reason
        if res.output_ids or res.finish_type != "abort":  # a request cut before it ran is no segment
            s.num_segments += 1
            step["num_segments"] += 1
        step["num_tokens_generated"] += len(res.output_ids)
        if res.finish_type == "stop":
            s.state = SampleState.COMPLETED
        elif res.finish_type == "abort":
            s.state = SampleState.ABORTED
            step["num_aborted_segments"] += 1
        elif self._budget(s) <= 0 or len(res.output_ids) < requested:
            # Fewer tokens than asked with "length" means the server clipped to its context: no room left.
            s.state = SampleState.TRUNCATED
        else:
            s.state = SampleState.PARTIAL

    def abort(self) -> None:
        """Abort the running step from another thread: in-flight segments come back aborted
        (tokens kept, resumed next step) and queued ones are not sent."""
        self.client.abort_all()

    # ------------------------------------------------------------------ metrics, checkpoints
    @property
    def num_buffered_groups(self) -> int:
        return len(self.buffer)

    def _metrics(self, step: dict[str, int], finished: list[RolloutGroup], seconds: float) -> dict[str, float]:
        samples = [s for g in finished for s in g.samples]
        out = {f"rollout/{k}": float(v) for k, v in step.items() if k in _COUNTERS}
        out["rollout/buffer_groups"] = float(len(self.buffer))
        out["rollout/buffer_samples_partial"] = float(sum(
            1 for g in self.buffer for s in g.samples if s.state in (SampleState.PARTIAL, SampleState.ABORTED)))
        out["rollout/step_s"] = seconds
        out["rollout/tokens_per_s"] = step["num_tokens_generated"] / seconds if seconds > 0 else 0.0
        if self.agent is not None:
            out.update(self.agent.metrics(step, samples))
        if samples:
            lengths = [s.response_length for s in samples]
            out["rollout/response_len_mean"] = sum(lengths) / len(lengths)
            out["rollout/response_len_max"] = float(max(lengths))
            out["rollout/frac_truncated"] = sum(s.state is SampleState.TRUNCATED for s in samples) / len(samples)
            out["rollout/segments_per_sample"] = sum(s.num_segments for s in samples) / len(samples)
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe buffer and counters (part of the trainer checkpoint)."""
        return {"format": STATE_FORMAT, "groups": [g.to_dict() for g in self.buffer], "totals": dict(self.totals)}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """What `load_state_dict` refuses (a format, groups of another size), found from the tree alone:
        cheap, so a resume this config cannot continue is refused before any token is rebuilt."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"partial-rollout state format {state.get('format')!r} is not {STATE_FORMAT}")
        bad = [g["group_id"] for g in state["groups"] if len(g["samples"]) != self.config.group_size]
        if bad:
            raise ValueError(f"partial-rollout state has groups of another size than "
                             f"PartialRolloutConfig.group_size={self.config.group_size}: {bad[:3]}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (its token lists may be numpy views of a checkpoint's flat arrays:
        `rollout.state_tokens`)."""
        self.check_state_dict(state)
        self.buffer = [RolloutGroup.from_dict(g) for g in state["groups"]]
        self.totals = {k: int(state.get("totals", {}).get(k, 0)) for k in self.counters}


class _Turn:
    """One sample's requests in this round, as the agent loop makes them (`AgentLoop.advance`): each
    `generate` is a segment of the single-turn path (its seed, routing, version labels and finish
    state), so the loop itself never touches log-probs or versions."""

    def __init__(self, manager: PartialRolloutManager, group: RolloutGroup, index: int, sample: Sample,
                 version: int, step: dict[str, int]) -> None:
        self.manager, self.group, self.index, self.sample, self.version, self.step = (
            manager, group, index, sample, version, step)
        self.epoch = manager.client.abort_epoch

    async def generate(self, max_new_tokens: int) -> GenerateResult:
        """Sample up to `max_new_tokens` after everything the sample holds; the tokens are recorded."""
        m, s = self.manager, self.sample
        res = await m._segment(s, m._request_seed(self.group, self.index, s), max_new_tokens)
        m._apply(s, res, self.version, self.step, requested=max_new_tokens)
        return res

    def room(self) -> int:
        """Tokens the sample may still add before max_response_tokens / the context is reached."""
        return self.manager._room(self.sample)

    def aborted(self) -> bool:
        """Whether `abort_all` came since the round began (a checkpoint's or a weight update's pause)."""
        return self.manager.client.abort_epoch != self.epoch


def _append_routing(s: Sample, res: GenerateResult) -> None:
    """Append a segment's routed experts (int32 rows `[routed_rows, rows + new - 1)`) to the sample
    (before its tokens are appended); raises ProtocolError when the reply's size does not fit."""
    import numpy as np

    rows = len(s.prompt_ids) + len(s.response_ids) + len(res.output_ids) - 1 - s.routed_rows
    ids = np.frombuffer(res.routed_experts, dtype="<i4")
    if rows <= 0:
        return
    if ids.size % rows or (s.routed_width and ids.size // rows != s.routed_width):
        raise ProtocolError(f"{res.url}/generate: meta_info.routed_experts holds {ids.size} ids for {rows} positions "
                            f"({s.routed_width or '?'} per position expected)")
    s.routed_width = ids.size // rows
    s.routed_experts += ids.astype("<i2").tobytes()


def flatten(groups: Sequence[RolloutGroup]) -> list[Sample]:
    """Samples of the groups in order (group-major), as the batch builder and GRPO expect."""
    return [s for g in groups for s in g.samples]
