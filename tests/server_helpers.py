"""Shared by the server tests: JSON over real loopback HTTP, and the `transformers` reference log-probs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional

import torch


def http(url: str, body: Any = None, *, method: str = "POST", raw: Optional[bytes] = None,
         timeout: float = 300.0, headers: Optional[dict] = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) for one request; `raw` sends bytes as they are (bad JSON tests),
    `headers` are added (e.g. Authorization)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def ref_logprobs(model, prompt: list, output: list) -> list:
    """log p(output[i] | prompt + output[:i]) by one full forward (no cache)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]
