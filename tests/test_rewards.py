"""Rewards: answer extraction on tricky strings, math-verify grading, plugin loading, batch scoring,
and the thread-safety of math-verify's timeouts (real worker threads and subprocesses)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import sys
import textwrap
import threading

import pytest

from megatron_bapo.rewards import (
    RewardSpecError,
    load_detailed_reward_fn,
    load_reward_fn,
    score_batch,
)
from megatron_bapo.rewards.extract import extract_answer, find_boxed, last_number, normalize_answer
from megatron_bapo.rewards.math import MathRewardConfig, math_reward, score_math

# ------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("\\boxed{\\boxed{7}}", "7"),  # nested boxes
        ("first \\boxed{3}, corrected: \\boxed{4}", "4"),  # multiple boxes -> last
        ("\\boxed{3} and then \\boxed{}", "3"),  # an empty last box is not an answer
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not close the box
        ("$\\boxed 5$", "5"),  # no braces
        ("\\fbox{12}", "12"),
        ("\\boxed{2.}", "2"),  # sentence punctuation
        ("\\boxed{\\text{5 cm}}", "\\text{5 cm}"),
        ("no box here 17", None),
        ("cut off \\boxed{\\frac{1}{2", None),  # unclosed box
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_find_boxed_ignores_other_commands_and_keeps_order():
    assert find_boxed("\\boxedx{1} \\boxed{2} \\fbox{3} \\boxed{4}") == ["2", "3", "4"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so x = 3 and y = -12", "-12"),
        ("total 1,234 apples", "1234"),
        ("ratio 3/4", "3/4"),
        ("pi is about 3.14.", "3.14"),
        ("no digits", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_last_number_fallback_is_optional():
    assert extract_answer("so the answer is 12", fallback_last_number=True) == "12"
    assert extract_answer("so the answer is 12") is None
    # A box always wins over the fallback.
    assert extract_answer("\\boxed{5} after 12", fallback_last_number=True) == "5"


@pytest.mark.parametrize(
    "variants",
    [
        ["\\frac{1}{2}", "\\dfrac{1}{2}", "\\frac12", "0.5", "1/2", "$0.50$"],
        ["70", "070", "70.", "\\text{70}"],
        ["5", "5 cm", "5\\,\\text{cm}", "5^\\circ"],
        ["1000", "1,000"],
        ["-3", "-3.0", "\\left(-3\\right)".replace("\\left(", "").replace("\\right)", "")],
        ["10", "10\\%"],
    ],
)
def test_normalize_answer_groups_equal_forms(variants):
    keys = {normalize_answer(v) for v in variants}
    assert len(keys) == 1, keys


def test_normalize_answer_keeps_different_answers_apart():
    assert normalize_answer("3") != normalize_answer("-3")
    assert normalize_answer("\\frac{1}{3}") != normalize_answer("0.33")
    assert normalize_answer(None) is None


# ------------------------------------------------------------------ grading


@pytest.mark.parametrize(
    "response, answer",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
        ("So the answer is $\\boxed{070}$.", "70"),  # AIME integer with a leading zero
        ("\\boxed{5 \\text{ cm}}", "5"),  # units
        ("\\boxed{5 cm}", "5"),
        ("\\boxed{-7}", "-7"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}"),
        ("\\boxed{x+1}", "1+x"),
        ("\\boxed{3} wait, no: \\boxed{4}", "4"),
        ("\\boxed{42}", "\\boxed{42}"),  # reference written with its own box
        ("\\boxed{12}", "$12$"),
    ],
)
def test_math_reward_correct(response, answer):
    result = score_math(response, answer)
    assert result.reward == 1.0 and result.reason == "correct" and not result.failed, result
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("\\boxed{-3}", "3"),
        ("\\boxed{4} wait, no: \\boxed{3}", "4"),  # only the last box counts
        ("\\boxed{0.33}", "\\frac{1}{3}"),
        ("\\boxed{71}", "70"),
    ],
)
def test_math_reward_wrong_is_not_a_failure(response, answer):
    result = score_math(response, answer)
    assert (result.reward, result.reason, result.failed) == (0.0, "wrong", False)


@pytest.mark.parametrize(
    "response, answer, reason",
    [
        ("I think it is 12", "12", "no_answer"),
        ("", "12", "no_answer"),
        ("\\boxed{\\frac{1}{2", "0.5", "no_answer"),
        ("\\boxed{@@##}", "3", "unparsable_answer"),
        ("\\boxed{" + "1" * 2000 + "}", "3", "answer_too_long"),
        ("\\boxed{3}", "", "bad_reference"),
    ],
)
def test_math_reward_failures_score_zero_with_reason(response, answer, reason):
    result = score_math(response, answer)
    assert (result.reward, result.reason, result.failed) == (0.0, reason, True)


def test_math_reward_last_number_fallback():
    assert load_reward_fn("math")("the answer is 12", "12") == 0.0
    assert load_reward_fn("math_last_number")("the answer is 12", "12") == 1.0
    assert score_math("the answer is 12", "12", MathRewardConfig(fallback_last_number=True)).reward == 1.0


def test_math_reward_non_string_input_does_not_crash():
    assert score_math(None, "1").reason == "error"  # type: ignore[arg-type]


def test_pathological_answer_times_out_in_main_thread_and_restores_alarm_handler():
    def mine(signum, frame):  # pragma: no cover - never fires
        raise AssertionError("outer handler fired")

    old = signal.signal(signal.SIGALRM, mine)
    try:
        result = score_math("\\boxed{9^{9^{9^{9}}}}", "5", MathRewardConfig(timeout_s=0.5))
        assert (result.reward, result.reason, result.failed) == (0.0, "timeout", True)
        assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------ worker threads / asyncio


def test_math_reward_works_in_worker_threads():
    # math-verify's own timeouts raise outside the main thread; our checker must still grade.
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0), ("\\boxed{070}", "70", 1.0)] * 3
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        got = list(pool.map(lambda c: math_reward(c[0], c[1]), cases))
    assert got == [c[2] for c in cases]


def test_math_reward_in_asyncio_to_thread_and_timeout_there():
    async def main():
        ok = await asyncio.to_thread(score_math, "\\boxed{\\dfrac{1}{2}}", "0.5")
        slow = await asyncio.to_thread(score_math, "\\boxed{9^{9^{9^{9}}}}", "5", MathRewardConfig(timeout_s=0.5))
        return ok, slow

    ok, slow = asyncio.run(main())
    assert ok.reason == "correct"
    assert (slow.reward, slow.reason, slow.failed) == (0.0, "timeout", True)
    # The pool's worker survived (or was replaced): the next threaded call still grades.
    result = []
    t = threading.Thread(target=lambda: result.append(score_math("\\boxed{2}", "2")))
    t.start()
    t.join(timeout=60)
    assert result and result[0].reason == "correct"


# ------------------------------------------------------------------ loading and batches


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def exact(response, answer):
                return float(response.strip() == answer.strip())

            def crashes(response, answer):
                raise RuntimeError("plugin bug")

            def returns_nan(response, answer):
                return float("nan")

            class Holder:
                @staticmethod
                def length(response, answer):
                    return float(len(response))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.scoring"
    for name in [m for m in sys.modules if m.startswith("my_rewards_pkg")]:
        del sys.modules[name]


def test_load_plugin_by_import_path(plugin_module):
    fn = load_reward_fn(f"{plugin_module}:exact")
    assert fn(" 12 ", "12") == 1.0 and fn("13", "12") == 0.0
    assert load_reward_fn(f"{plugin_module}:Holder.length")("abc", "") == 3.0


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_such_builtin", "built-in name"),
        ("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "not a callable"),
        ("{mod}:", "import path"),
        ("", "non-empty"),
    ],
)
def test_load_errors_name_the_spec(plugin_module, spec, fragment):
    spec = spec.format(mod=plugin_module)
    with pytest.raises(RewardSpecError) as info:
        load_reward_fn(spec)
    assert fragment in str(info.value)
    if spec:
        assert repr(spec) in str(info.value)


def test_builtin_arithmetic_loads_lazily():
    pytest.importorskip("megatron_bapo.rewards.arithmetic", reason="rewards/arithmetic.py (tiny engineer) not landed")
    fn = load_reward_fn("arithmetic")
    assert callable(fn)


def test_plugin_failures_are_counted_not_raised(plugin_module):
    detailed = load_detailed_reward_fn(f"{plugin_module}:crashes")
    result = detailed("a", "b")
    assert (result.reward, result.reason, result.failed) == (0.0, "error", True)
    nan = load_detailed_reward_fn(f"{plugin_module}:returns_nan")("a", "b")
    assert (nan.reward, nan.reason, nan.failed) == (0.0, "invalid_reward", True)


@pytest.mark.parametrize("num_workers", [0, 3])
def test_score_batch_math_in_order_with_counts(num_workers):
    responses = ["\\boxed{1}", "\\boxed{2}", "no answer", "\\boxed{0.5}", "\\boxed{@@}", "\\boxed{3"]
    answers = ["1", "1", "1", "\\frac{1}{2}", "1", "3"]
    scores = score_batch("math", responses, answers, num_workers=num_workers)
    assert scores.rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert scores.num_failed == 3
    assert scores.failure_counts == {"no_answer": 2, "unparsable_answer": 1}


def test_score_batch_plugin_and_callable(plugin_module):
    scores = score_batch(f"{plugin_module}:exact", ["1", "2"], ["1", "1"], num_workers=2)
    assert scores.rewards == [1.0, 0.0] and scores.num_failed == 0
    crash = score_batch(load_reward_fn(f"{plugin_module}:crashes"), ["1", "2"], ["1", "1"])
    assert crash.rewards == [0.0, 0.0] and crash.failure_counts == {"error": 2}


def test_score_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score_batch("math", ["a", "b"], ["1"])


def test_dead_worker_process_is_replaced():
    from megatron_bapo.rewards import math as math_mod

    def in_thread(response, answer):
        out = []
        t = threading.Thread(target=lambda: out.append(score_math(response, answer, MathRewardConfig(num_workers=1))))
        t.start()
        t.join(timeout=120)
        return out[0]

    assert in_thread("\\boxed{3}", "3").reason == "correct"
    pool = math_mod._worker_pool(1)
    idle = list(pool._idle.queue)
    assert len(idle) == 1
    idle[0].process.kill()  # our own child process, by its handle
    idle[0].process.wait(timeout=30)
    assert in_thread("\\boxed{0.5}", "\\frac{1}{2}").reason == "correct"
    assert pool._idle.queue[0].process.pid != idle[0].process.pid


def test_plugin_reward_that_hangs_times_out_and_one_that_raises_says_why(tmp_path, monkeypatch):
    """Plugin rewards run in worker processes: a call still running after timeout_s is killed and
    scores 0 ("timeout") instead of hanging the run; an exception scores 0 with its text kept."""
    import sys
    import time

    (tmp_path / "hang_reward_mod.py").write_text(
        "import time\n"
        "def reward(response, answer):\n"
        "    if response == 'hang':\n"
        "        time.sleep(600)\n"
        "    if response == 'raise':\n"
        "        raise ValueError('no such answer format')\n"
        "    return float(response == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    started = time.monotonic()
    scores = score_batch("hang_reward_mod:reward", ["1", "hang", "raise", "2"], ["1", "1", "1", "1"], timeout_s=2.0)
    assert time.monotonic() - started < 30
    assert [r.reason for r in scores.results] == ["scored", "timeout", "error", "scored"]
    assert scores.rewards == [1.0, 0.0, 0.0, 0.0]
    assert "no such answer format" in scores.results[2].error and "timeout_s" in scores.results[1].error
    assert scores.num_fn_failures == 2


def test_plugin_reward_that_prints_does_not_break_its_worker(tmp_path, monkeypatch):
    """What a plugin prints (at import, from Python per call, or onto fd 1 from C) never reaches the
    worker's reply channel; before, the first printed line was read as the reply and the call failed."""
    import sys

    (tmp_path / "chatty_reward_mod.py").write_text(
        "import os\n"
        "print('loading the chatty reward')\n"
        "def reward(response, answer):\n"
        "    print('scoring', response)\n"
        "    os.write(1, b'raw bytes on fd 1\\n')\n"
        "    return float(response == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    scores = score_batch("chatty_reward_mod:reward", ["1", "2", "1"], ["1", "1", "1"], timeout_s=20.0)
    assert [r.reason for r in scores.results] == ["scored"] * 3 and scores.rewards == [1.0, 0.0, 1.0]


def test_a_worker_whose_trainer_is_gone_exits_without_a_traceback():
    """When the reading end of a worker's reply pipe is gone (the trainer was killed), the worker
    exits 0 and silently; before, its BrokenPipeError traceback landed on the trainer's terminal
    after the run's one-line error."""
    import json
    import subprocess

    worker = subprocess.Popen([sys.executable, "-m", "megatron_bapo.rewards.sandbox", "megatron_bapo.rewards.math:math_reward"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "ready\n"
    worker.stdout.close()  # the trainer is gone
    worker.stdin.write(json.dumps({"response": "\\boxed{1}", "answer": "1"}) + "\n")
    worker.stdin.close()
    assert worker.wait(timeout=60) == 0
    assert worker.stderr.read() == ""
