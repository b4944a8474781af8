"""Routed experts: what every MoE layer chose for each token, as SGLang returns it for routing replay.

SGLang 0.5.23 (`--enable-return-routed-experts`, request field `return_routed_experts`): the reply's
`meta_info["routed_experts"]` is the base64 of an int32 array `[rows, num_hidden_layers, top_k]`
covering positions `[routed_experts_start_len, seqlen - 1)` of prompt + output, row p being the experts
the layers chose when position p was computed (the last output token is never fed to the model, so it
has none). Without the launch flag the field is ignored and the reply has no routing; a start outside
`[0, len(input_ids)]` is a 400.

The built-in server records the same with forward hooks on the transformers model's routers
(`Qwen3MoeTopKRouter`, whose output is `(logits, weights, indices)`): the engine brackets each
forward with `start()` / `take()` and hands each request its rows (a prefill: every position of its
context, right-aligned in a left-padded batch; a decode step: the position it fed). Re-prefilling
a context (a resumed request after a retract) overwrites its rows, as SGLang's KV-slot-indexed
capture does.
"""

from __future__ import annotations

import base64
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router module) of every MoE layer of an HF causal LM."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            out.append((i, gate))
    return out


class RoutingCapture:
    """Forward hooks on a model's routers; `take()` returns one forward's `[tokens, L, k]` int32."""

    def __init__(self, model) -> None:
        routers = moe_routers(model)
        if not routers:
            raise ValueError(f"--enable-return-routed-experts needs a mixture-of-experts model; "
                             f"{type(model).__name__} has no MoE router")
        self.num_layers = int(model.config.num_hidden_layers)
        self.top_k = int(model.config.num_experts_per_tok)
        self._seen: dict[int, torch.Tensor] = {}
        self._active = False
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in routers]

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            if self._active:
                self._seen[layer] = output[2].detach()
        return record

    def start(self) -> None:
        self._seen = {}
        self._active = True

    def take(self) -> torch.Tensor:
        """The experts of the forward since `start()`: `[tokens, num_layers, top_k]` int32, -1 for
        layers without experts (tokens in the model's flattened `[batch, seq]` order)."""
        self._active = False
        if not self._seen:
            raise RuntimeError("RoutingCapture.take(): no router ran since start()")
        tokens = next(iter(self._seen.values())).shape[0]
        out = torch.full((tokens, self.num_layers, self.top_k), -1, dtype=torch.int32)
        for layer, idx in self._seen.items():
            out[:, layer] = idx.to(torch.int32)
        self._seen = {}
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def encode_rows(rows: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 array's bytes (row-major `[rows, L, k]`)."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def keep_routing(req, rows: Optional[torch.Tensor], *, prefill: bool) -> None:
    """File a forward's rows with a request that asked for its routing: a (re-)prefill replaces
    everything (it computed every position of its context again), a decode step appends its row."""
    if rows is None or not req.item.return_routed_experts:
        return
    if prefill:
        req.routed_prefill, req.routed_decode = rows.clone(), []
    else:
        req.routed_decode.append(rows.clone())


def request_rows(prefill: Optional[torch.Tensor], decoded: list, start: int, seqlen: int) -> Optional[torch.Tensor]:
    """Rows `[start, seqlen - 1)` of a request's routing (prefill rows, then one per decode step),
    or None when it was never computed (aborted while waiting)."""
    if prefill is None:
        return None
    rows = torch.cat([prefill, *decoded]) if decoded else prefill
    end = max(seqlen - 1, 0)
    return rows[min(start, end):end]
