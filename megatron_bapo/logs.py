"""Where the trainer's log records go. The CLI (`megatron_bapo.train`) calls `configure`; the
library itself only uses `logging`.

Rank 0:
  * every record at `trainer.log_level` is appended to `<trainer.output_dir>/logs/train.log`;
  * the console (stderr) shows WARNING and above, plus what is logged to the `CONSOLE` logger
    (`megatron_bapo.console`): the compact line every `trainer.console_every` steps, eval results,
    resume and the end of the run, as bare messages.
Console output goes through `tqdm.write`, so a line never breaks the progress bar. Python
warnings become log records (`py.warnings`), so they land in the file and above the bar too.

Other ranks: WARNING and above to stderr, as before.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

CONSOLE = "megatron_bapo.console"
"""Logger whose INFO records reach rank 0's console (and the log file)."""


def log_file(output_dir: str | Path) -> Path:
    """The run's log file: `<output_dir>/logs/train.log`."""
    return Path(output_dir) / "logs" / "train.log"


class TqdmHandler(logging.StreamHandler):
    """A stderr handler that writes through `tqdm.write`: an active progress bar is cleared, the
    line printed, and the bar redrawn below it (plain printing when no bar is open)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def configure(level: str, rank: int, output_dir: Optional[str | Path] = None) -> Optional[Path]:
    """Set up logging for one trainer process; returns the log file (rank 0 with `output_dir`)."""
    fmt = f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"
    if rank != 0:
        logging.basicConfig(level=logging.WARNING, format=fmt)
        return None
    root = logging.getLogger()
    root.setLevel(level.upper())
    console = TqdmHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter(fmt))
    root.addHandler(console)
    path = None
    if output_dir is not None:
        path = log_file(output_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        file_handler.setLevel(level.upper())
        file_handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(file_handler)
    # The console logger's own handler prints its records bare; they also propagate to the root's
    # handlers, where the file keeps them (the root's console handler drops them: below WARNING).
    lines = logging.getLogger(CONSOLE)
    lines.setLevel(logging.INFO)
    bare = TqdmHandler()
    bare.setLevel(logging.INFO)
    bare.addFilter(lambda record: record.levelno < logging.WARNING)  # warnings: the root's console handler
    lines.addHandler(bare)
    logging.captureWarnings(True)
    return path
