"""Rank 0's console and log file (megatron_bapo.logs) with the trainer's reporting: every record
goes to `<output_dir>/logs/train.log`; the console gets warnings, one compact line every
`trainer.console_every` steps (means over the steps since the previous line) and eval results."""

from __future__ import annotations

import logging
import statistics
import warnings

import pytest

from megatron_bapo import logs
from megatron_bapo.config import load_run_config
from megatron_bapo.config_io import ConfigError
from megatron_bapo.trainer import Trainer


@pytest.fixture
def restore_logging():
    root, lines = logging.getLogger(), logging.getLogger(logs.CONSOLE)
    saved = root.handlers[:], root.level, lines.handlers[:], lines.level
    yield
    for handler in root.handlers + lines.handlers:
        if handler not in saved[0] + saved[2]:
            handler.close()
    root.handlers[:], lines.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    lines.setLevel(saved[3])
    logging.captureWarnings(False)


class _Driver:
    def __init__(self):
        self.logged = []

    def log(self, step, metrics):
        self.logged.append(step)


def _metrics(step: int) -> dict[str, float]:
    m = {"rollout/reward_mean": step / 100, "rollout/accuracy": step / 200, "timing/step_s": 1.0 + step % 3}
    if step != 1:  # step 1 made no update: no bapo/actor tags
        m.update({"bapo/c_low": 0.6, "bapo/c_high": 1.2 + step / 100, "bapo/rho_before": 0.3, "bapo/rho_after": 0.41,
                  "actor/entropy": 0.5})
    if step == 20:
        m.update({"eval/tiny_test/avg@4": 0.52, "eval/tiny_test/pass@4": 0.8})
    return m


def test_file_gets_everything_console_gets_warnings_and_compact_lines(tmp_path, capsys, restore_logging):
    path = logs.configure("info", 0, tmp_path)
    assert path == tmp_path / "logs" / "train.log"
    config = load_run_config(None, ["model.hf_path=m", "data.path=d.jsonl", f"trainer.output_dir={tmp_path}",
                                    "trainer.total_steps=25", "trainer.console_every=10", "trainer.progress=false"])
    trainer = Trainer(config)
    trainer.driver = _Driver()
    log = logging.getLogger("megatron_bapo.somewhere")
    log.info("detail for the file")
    log.debug("debug: nowhere at info")
    log.warning("something to act on")
    warnings.warn("a python warning", UserWarning)
    for step in range(1, 26):
        trainer.step = step
        trainer._report(_metrics(step), None)
    err = capsys.readouterr().err

    def line(first: int, last: int) -> str:
        window = [_metrics(s) for s in range(first, last + 1)]

        def mean(key):
            return statistics.fmean(m[key] for m in window if key in m)

        return (f"step {last}/25  reward {mean('rollout/reward_mean'):.3f}  acc {mean('rollout/accuracy'):.3f}  "
                f"c_low {mean('bapo/c_low'):.2f} c_high {mean('bapo/c_high'):.2f}  "
                f"rho {mean('bapo/rho_before'):.2f}->{mean('bapo/rho_after'):.2f}  "
                f"entropy {mean('actor/entropy'):.2f}  {mean('timing/step_s'):.1f} s/step")

    expected = [line(1, 10), line(11, 20), line(21, 25)]  # every 10 steps and the last
    assert [ln for ln in err.splitlines() if ln.startswith("step ")] == expected
    assert "eval step 20  tiny_test avg@4 0.520" in err.splitlines()
    assert [ln for ln in err.splitlines() if " WARNING " in ln][0].endswith("megatron_bapo.somewhere: something to act on")
    assert "a python warning" in err
    assert "detail for the file" not in err and "step 7:" not in err
    assert trainer.driver.logged == list(range(1, 26))

    text = path.read_text()
    assert "INFO megatron_bapo.somewhere: detail for the file" in text and "debug: nowhere" not in text
    assert "WARNING megatron_bapo.somewhere: something to act on" in text and "a python warning" in text
    assert "INFO megatron_bapo.trainer: step 7: reward=0.07" in text  # every step, in full
    assert all(ln in text for ln in expected) and "eval step 20  tiny_test avg@4 0.520" in text


def test_console_every_zero_prints_no_step_lines_and_debug_reaches_the_file(tmp_path, capsys, restore_logging):
    path = logs.configure("debug", 0, tmp_path)
    config = load_run_config(None, ["model.hf_path=m", "data.path=d.jsonl", "trainer.total_steps=3",
                                    "trainer.console_every=0", "trainer.progress=false"])
    trainer = Trainer(config)
    trainer.driver = _Driver()
    for step in range(1, 4):
        trainer.step = step
        trainer._report(_metrics(step), None)
    logging.getLogger("megatron_bapo.somewhere").debug("a debug detail")
    err = capsys.readouterr().err
    assert not [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert "DEBUG megatron_bapo.somewhere: a debug detail" in path.read_text()
    with pytest.raises(ConfigError, match="console_every"):
        load_run_config(None, ["model.hf_path=m", "data.path=d.jsonl", "trainer.console_every=-1"])
