"""The worker process of one tool (`python -m megatron_bapo.rollout.tools.sandbox PATH OPTIONS MAX_CHARS`).

Started and fed by `rollout.tools.ToolRunner` through a `rewards.workers` pool: one JSON request
`{"arguments": {...}}` per line, one reply `{"status", "text"}` per line. The tool function is
imported once. Its result is its return value (a string as is, anything else as JSON), or, when it
returns None, what it printed; both are cut to MAX_CHARS here, so no reply is large whatever the
tool does. An exception becomes an "error" reply with its type and message; `ToolError` carries the
message meant for the model. Keyword arguments named in OPTIONS (a JSON object from the config) are
bound here and cannot be passed by the model.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any, Callable


class _BoundedWriter(io.TextIOBase):
    """A text stream that keeps the first `limit` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.kept, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(s[:room])
            self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def getvalue(self) -> str:
        return "".join(self.parts)


def call_tool(fn: Callable[..., Any], options: dict, request: dict, max_chars: int) -> dict:
    """One call of `fn` (in this worker): the reply dict; never raises for the tool's own failure."""
    from megatron_bapo.rollout.tools import ToolError, bound_text

    arguments = request.get("arguments")
    if not isinstance(arguments, dict):
        return {"status": "error", "text": "error: the arguments must be a JSON object"}
    fixed = sorted(set(arguments) & set(options))
    if fixed:
        return {"status": "error", "text": f"error: argument(s) {fixed} are fixed by the configuration"}
    captured = _BoundedWriter(max_chars + 1)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = captured
    try:
        value = fn(**arguments, **options)
    except ToolError as exc:
        return {"status": "error", "text": bound_text(f"error: {exc}", max_chars)[0]}
    except BaseException as exc:  # noqa: BLE001 - a plugin's failure (even sys.exit) is a message for the model
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"status": "error", "text": bound_text(f"error: {type(exc).__name__}: {exc}", max_chars)[0]}
    finally:
        sys.stdout, sys.stderr = saved
    total = None
    if value is None:
        text, total = captured.getvalue(), captured.kept + captured.dropped
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    text, cut = bound_text(text, max_chars, total=total)
    return {"status": "truncated" if cut else "ok", "text": text}


def worker_main(path: str, options_json: str, max_chars: str) -> None:
    from megatron_bapo.rewards import workers
    from megatron_bapo.rollout.tools import load_tool_fn

    out = workers.reply_channel()  # before the import: a tool printing at import cannot break the replies
    fn = load_tool_fn(path)
    options, limit = json.loads(options_json), int(max_chars)
    workers.serve(lambda req: call_tool(fn, options, req, limit), out)


if __name__ == "__main__":
    worker_main(*sys.argv[1:4])
