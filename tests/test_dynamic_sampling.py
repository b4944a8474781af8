"""Dynamic sampling (off / filter / refill) on a scripted rollout: what each step trains, draws and drops.

The rollout is a stand-in for `PartialRolloutManager.astep` with the same contract (start groups for
new prompts, advance every buffered group one segment, return the finished ones oldest first, take
requeued groups back at the front), where a group needs `segments` rounds and the rewards of prompt
i's samples are scripted: zero variance when `i % zero_every == 0`. Every prompt drawn must end up
trained, dropped or still buffered, exactly once.
"""

from __future__ import annotations

import asyncio

import pytest

from megatron_bapo.rollout.dynamic_sampling import DynamicSampler, zero_variance
from megatron_bapo.rollout.types import RolloutRound
from megatron_bapo.rollout.types import Prompt, RolloutGroup, Sample, SampleState

G = 4


class ScriptedRollout:
    def __init__(self, segments=1, zero_every=3, fail_on_call=None):
        self.segments, self.zero_every, self.fail_on_call = segments, zero_every, fail_on_call
        self.buffer: list[RolloutGroup] = []
        self.progress: dict[str, int] = {}
        self.calls = 0
        self.next_index = 0
        self.scored: list[str] = []
        self.versions: list[int] = []
        self.advanced = 0

    def draw(self, n):
        out = [Prompt(prompt_ids=[1, 2], answer="", index=self.next_index + i) for i in range(n)]
        self.next_index += n
        return out

    async def advance(self, prompts, version, only_aborted=False):
        self.calls += 1
        self.versions.append(version)
        for p in prompts:
            gid = f"g{p.index}"
            self.buffer.append(RolloutGroup(group_id=gid, prompt=p, start_version=version,
                                            samples=[Sample(prompt_ids=[1, 2]) for _ in range(G)]))
            self.progress[gid] = 0
        if self.fail_on_call == self.calls:
            raise RuntimeError("every server failed")
        finished, kept = [], []
        for g in self.buffer:
            if not g.finished:
                self.advanced += 1
                self.progress[g.group_id] += 1
                if self.progress[g.group_id] >= self.segments:
                    for s in g.samples:
                        s.state, s.response_ids, s.num_segments = SampleState.COMPLETED, [5], self.segments
            (finished if g.finished else kept).append(g)
        self.buffer = kept
        return RolloutRound(prompts=list(prompts), groups=finished, metrics={"rollout/num_segments": 1.0,
                                                                             "rollout/buffer_groups": len(kept)})

    def in_flight(self):
        return sum(1 for g in self.buffer if not g.finished)

    def uniform(self, index):
        """Whether prompt `index`'s rewards are all equal (scripted)."""
        return index % self.zero_every == 0

    def score(self, groups):
        for g in groups:
            self.scored.append(g.group_id)
            uniform = self.uniform(g.prompt.index)
            for j, s in enumerate(g.samples):
                s.reward = 1.0 if uniform else float(j % 2)
        return _Stats(len(groups))

    def requeue(self, groups):
        self.buffer[:0] = groups

    def sampler(self, mode, prompts_per_step=4, max_refill_rounds=5):
        return DynamicSampler(mode=mode, prompts_per_step=prompts_per_step, max_refill_rounds=max_refill_rounds,
                              draw=self.draw, advance=self.advance, score=self.score, requeue=self.requeue,
                              sample_metrics=lambda samples: {"rollout/samples_seen": float(len(samples))},
                              in_flight=self.in_flight)


class _Stats:
    def __init__(self, n):
        self.n = n

    def add(self, other):
        self.n += other.n

    def metrics(self):
        return {"reward/groups_scored": float(self.n)}


def _run(sampler, steps):
    return [asyncio.run(sampler.produce(version=0)) for _ in range(steps)]


def _accounted(rollout, rounds):
    drawn = [p.index for r in rounds for p in r.prompts]
    trained = [g.prompt.index for r in rounds for g in r.groups]
    dropped = [g.prompt.index for r in rounds for g in r.dropped]
    buffered = [g.prompt.index for g in rollout.buffer]
    assert sorted(trained + dropped + buffered) == sorted(drawn), "a prompt was lost or counted twice"
    assert len(rollout.scored) == len(set(rollout.scored)), "a group was scored twice"
    return drawn, trained, dropped


def test_off_trains_every_finished_group_and_reports_the_zero_variance_share():
    rollout = ScriptedRollout()
    rounds = _run(rollout.sampler("off"), 3)
    _, trained, dropped = _accounted(rollout, rounds)
    assert len(trained) == 12 and not dropped
    assert [r.metrics["rollout/zero_variance_frac"] for r in rounds] == [0.5, 0.25, 0.25]  # 0, 3 | 6 | 9
    assert "rollout/refill_rounds" not in rounds[0].metrics and "experience/num_groups_filtered" not in rounds[0].metrics


def test_filter_drops_zero_variance_groups():
    rollout = ScriptedRollout()
    rounds = _run(rollout.sampler("filter"), 3)
    _, trained, dropped = _accounted(rollout, rounds)
    assert dropped == [0, 3, 6, 9] and len(trained) == 8
    assert all(not zero_variance(g) for r in rounds for g in r.groups)
    assert [r.metrics["experience/num_groups_filtered"] for r in rounds] == [2.0, 1.0, 1.0]


def test_refill_trains_exactly_prompts_per_step_informative_groups():
    rollout = ScriptedRollout(zero_every=2)  # half the prompts carry no signal
    sampler = rollout.sampler("refill", prompts_per_step=4)
    rounds = _run(sampler, 5)
    drawn, trained, dropped = _accounted(rollout, rounds)
    assert [len(r.groups) for r in rounds] == [4] * 5
    assert all(not zero_variance(g) for r in rounds for g in r.groups)
    assert all(r.metrics["rollout/refill_cap_hit"] == 0 for r in rounds)
    # The first step knows no equal-reward share yet (its first draw: 4 x 1.1 headroom = 5 prompts), so
    # it refills; later draws are oversampled by the observed share and carry the surplus over.
    assert rounds[0].metrics["rollout/refill_rounds"] >= 1 and rounds[0].metrics["rollout/num_prompts_drawn"] > 5
    assert sum(r.metrics["rollout/refill_rounds"] for r in rounds[1:]) <= 1
    assert any(r.metrics["rollout/num_surplus_groups"] for r in rounds)
    assert len(drawn) <= len(trained) + len(dropped) + len(rollout.buffer)
    # Per-sample metrics (the agent loop's) cover every group the step finished, across its rounds.
    assert rounds[0].metrics["rollout/samples_seen"] == len(rounds[0].prompts) * G


def test_refill_at_the_32b_proportions_needs_about_one_round_per_step():
    """The 32B recipe's proportions: 64 prompts per step, responses of 4 segments (a group finishes 4
    rounds after its draw), 30% of the groups with equal rewards (seeded, not periodic). After the
    pipeline fills (4 steps), 20 refill steps average <= 1.3 rollout rounds (at b74de61: 5.0, each
    refill round drew only the shortfall and the first round's groups were not counted in flight),
    and a round advances >= 90% as many groups as under `filter`."""
    import random

    def run(mode):
        rollout = ScriptedRollout(segments=4)
        draws = random.Random(7)
        uniform = {}
        rollout.uniform = lambda i: uniform.setdefault(i, draws.random() < 0.3)
        sampler = rollout.sampler(mode, prompts_per_step=64, max_refill_rounds=8)
        per_step, advanced = [], []
        for step in range(24):
            calls, groups = rollout.calls, rollout.advanced
            done = asyncio.run(sampler.produce(version=step))
            if step >= 4:
                per_step.append(rollout.calls - calls)
                advanced.append((rollout.advanced - groups) / (rollout.calls - calls))
                if mode == "refill":
                    assert len(done.groups) == 64 and done.metrics["rollout/refill_cap_hit"] == 0
        return sum(per_step) / len(per_step), sum(advanced) / len(advanced)

    filter_rounds, filter_advanced = run("filter")
    refill_rounds, refill_advanced = run("refill")
    assert filter_rounds == 1.0
    assert refill_rounds <= 1.3, f"refill took {refill_rounds:.2f} rollout rounds per step"
    assert refill_advanced >= 0.9 * filter_advanced, (refill_advanced, filter_advanced)


def test_refill_rounds_read_the_version_the_servers_serve_now():
    """A sync can land between two refill rounds of a step: each round reads the served version (its
    staleness cap, start_version and seeds), not the one the producer read when the step began
    (b74de61). Driven through the real producer on a client's loop (no request is sent)."""
    from megatron_bapo.rollout import RolloutClient, RolloutClientConfig
    from megatron_bapo.rollout.producer import RolloutProducer

    rollout = ScriptedRollout(zero_every=1)  # no signal: the step runs every refill round
    served = [3]
    advance = rollout.advance

    async def a_sync_after_each_round(prompts, version, only_aborted=False):
        done = await advance(prompts, version)
        served[0] += 1
        return done
    rollout.advance = a_sync_after_each_round
    sampler = rollout.sampler("refill", max_refill_rounds=2)
    with RolloutClient(RolloutClientConfig(urls=["http://127.0.0.1:9"])) as client:
        producer = RolloutProducer(client, None, sampler.produce, ahead=0, served_version=lambda: served[0])
        producer.start()
        done, _ = producer.next()
        producer.stop()
    assert rollout.versions == [3, 4, 5]
    assert done.metrics["rollout/refill_rounds"] == 2.0


def test_refill_stops_at_the_cap_and_says_so():
    rollout = ScriptedRollout(zero_every=1)  # no prompt carries signal
    [done] = _run(rollout.sampler("refill", prompts_per_step=3, max_refill_rounds=2), 1)
    _accounted(rollout, [done])
    assert done.groups == [] and rollout.calls == 3
    # Every group drawn came back with no signal: each refill round oversampled by at most 10x (the
    # share is clipped at 0.9), so the step drew 4 (3 x 1.1), then 33 and 33 prompts.
    assert len(done.dropped) == 70
    assert done.metrics["rollout/refill_cap_hit"] == 1.0 and done.metrics["rollout/refill_rounds"] == 2.0


def test_refill_under_partial_rollout_waits_for_its_draws_and_carries_the_surplus():
    """Groups take 2 rounds: a refill round does not draw again for groups still generating, the
    surplus goes back to the buffer (scored once) and the next step draws that many fewer prompts."""
    rollout = ScriptedRollout(segments=2, zero_every=3)
    sampler = rollout.sampler("refill", prompts_per_step=3, max_refill_rounds=4)
    rounds = _run(sampler, 6)
    drawn, trained, _ = _accounted(rollout, rounds)
    assert [len(r.groups) for r in rounds] == [3] * 6
    # The first step waits a round for its draws, then refills; later steps draw ahead of their need.
    assert all(r.metrics["rollout/refill_rounds"] <= 3 for r in rounds)
    assert len(drawn) <= len(trained) + 3 * len(rounds) + len(rollout.buffer)
    carried = [r.metrics["rollout/num_surplus_groups"] for r in rounds]
    assert any(carried) and sampler.state_dict()["carried"] == carried[-1]
    assert len(trained) == len(set(trained))


def test_a_failed_round_keeps_its_prompts_for_the_step_that_completes():
    rollout = ScriptedRollout(zero_every=2, fail_on_call=2)  # the first refill round fails
    sampler = rollout.sampler("refill", prompts_per_step=4)
    with pytest.raises(RuntimeError, match="every server failed"):
        asyncio.run(sampler.produce(version=0))
    state = sampler.state_dict()
    # First round: 5 prompts (4 x 1.1), 1 and 3 informative; the refill round drew 6 (share 3/5) and failed.
    assert len(state["step"]["drawn"]) == 11 and len(state["step"]["kept"]) == 2
    again = rollout.sampler("refill", prompts_per_step=4)
    again.load_state_dict(state)  # a restarted producer (or a resumed run) continues the same step
    done = asyncio.run(again.produce(version=0))
    _accounted(rollout, [done])
    assert len(done.groups) == 4 and [p.index for p in done.prompts][:11] == list(range(11))


def test_an_interrupted_step_stops_between_rounds_and_resumes_without_drawing_again():
    """A checkpoint's `pause(abort=True)` interrupts a refilling step between its rounds: the step is
    kept (and saved), and the next `produce` refills it without running its first round again."""
    from megatron_bapo.rollout.errors import RoundInterrupted

    rollout = ScriptedRollout(zero_every=2)
    sampler = rollout.sampler("refill", prompts_per_step=4)
    advance = rollout.advance

    async def interrupted_after_first_round(prompts, version, only_aborted=False):
        done = await advance(prompts, version)
        sampler.interrupt(True)  # what the producer does when a checkpoint pauses mid-round
        return done
    sampler.advance = interrupted_after_first_round
    with pytest.raises(RoundInterrupted):
        asyncio.run(sampler.produce(version=0))
    state = sampler.state_dict()
    assert state["step"]["first_round_done"] and len(state["step"]["drawn"]) == 5 and rollout.calls == 1
    again = rollout.sampler("refill", prompts_per_step=4)  # resumed from the checkpoint
    again.load_state_dict(state)
    done = asyncio.run(again.produce(version=0))
    _accounted(rollout, [done])
    # 1 and 3 kept by the first round; one refill round of 6 prompts (5..10) keeps 5, 7 and 9.
    assert len(done.groups) == 4 and [p.index for p in done.prompts] == list(range(11))
    assert done.metrics["rollout/refill_rounds"] == 1.0 and rollout.calls == 2
