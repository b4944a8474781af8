"""How a weight update meets the generation in flight on the servers (`sync.pause_mode`).

- None: no pause. Each server's update waits for its in-flight `/generate` calls (SGLang's writer
  lock) and new ones wait for the update: with partial rollout the update lands between segments.
- "abort": `/pause_generation {"mode": "abort"}` returns every in-flight call with its partial
  tokens (the samples resume under the new weights as their next segment), then update, continue.
- "retract" / "in_place": requests stay open and continue on the new weights after
  `/continue_generation`; the reply's `weight_versions` spans say which version produced each
  token (SGLang >= 0.5.15 and the built-in server). "retract" re-prefills them with the new
  weights; "in_place" keeps their KV cache, computed by the old ones.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

PAUSE_MODES = (None, "abort", "retract", "in_place")


@contextlib.contextmanager
def paused(client: Any, mode: Optional[str]) -> Iterator[None]:
    """Pause generation on every server for the update inside (nothing when `mode` is None)."""
    if mode is None or client is None:
        yield
        return
    client.pause_generation(mode)
    try:
        yield
    finally:
        client.continue_generation()
