"""Declarative HF <-> megatron-core weight mapping: rules, tensor transforms, TP split/merge, registry.

A model family is a `ModelMapping`: a list of `TensorRule`s, each naming one megatron-core tensor
(with aliases for the local and the Transformer Engine layer spec), the HF tensor(s) it is made of,
and a `kind` that says how the HF tensors fuse into it and how it splits across tensor-parallel ranks.

"Full" megatron tensors below are always in the TP=1 layout:
- `qkv`: rows grouped per query group g as [q heads of g; k_g; v_g] (megatron's GQA interleaving);
  TP rank r holds the contiguous groups r*ng/tp .. (r+1)*ng/tp - 1, i.e. a plain dim-0 chunk.
- `gate_up`: [gate; up] (SwiGLU linear_fc1); TP rank r holds [gate_r; up_r], NOT a dim-0 chunk.
- `vocab`: rows padded with zeros from the HF `vocab_size` to the padded vocab size; dim-0 chunks.
- `column` / `row`: dim-0 / dim-1 chunks; `replicated`: same on every TP rank.

Experts (a mixture of experts): a rule whose names hold `{e}` has one tensor per expert. On the HF
side `{e}` is the global expert index (`model.layers.3.mlp.experts.17.gate_proj.weight`); in a live
model it is the index among this expert-parallel rank's local experts (megatron's `SequentialMLP`
`local_experts.{e}`, TE's grouped `linear_fc1.weight{e}`), whose global index the MoE layer knows
(`local_expert_indices`); expert tensors split over the expert-tensor-parallel group, not the TP
group. In `torch_dist` checkpoints every expert tensor of a layer stack is one key with a layer and an
expert axis (`TensorRule.checkpoint_key`), so checkpoints reshard between expert-parallel sizes.

Each family's mapping lives in its own file under `convert/families/`; the explicit table there
(`families.MAPPINGS`, `families.get_mapping`) is keyed by the HF `architectures` name. This module
knows no family, so the dependency runs one way: families -> mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

KINDS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")


@dataclass(frozen=True)
class ShapeInfo:
    """The model dimensions the transforms need (from the HF config)."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    num_layers: int
    tie_word_embeddings: bool
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""

    @classmethod
    def from_hf_config(cls, hf_config: Any, *, vocab_divisible_by: int = 128) -> "ShapeInfo":
        from megatron_bapo.models.registry import model_args_from_hf

        args = model_args_from_hf(hf_config, vocab_divisible_by=vocab_divisible_by)
        ck = args.config_kwargs
        return cls(
            num_attention_heads=ck["num_attention_heads"],
            num_query_groups=ck["num_query_groups"],
            head_dim=ck["kv_channels"],
            vocab_size=args.vocab_size,
            padded_vocab_size=args.padded_vocab_size,
            num_layers=ck["num_layers"],
            tie_word_embeddings=bool(args.gpt_kwargs["share_embeddings_and_output_weights"]),
            num_experts=int(ck.get("num_moe_experts") or 0),
        )


@dataclass(frozen=True)
class TensorRule:
    """One megatron-core tensor and the HF tensors it is made of.

    Names may contain `{i}` (the global layer index) and `{e}` (the expert: global on the HF side,
    local to the expert-parallel rank in megatron names). `megatron[0]` is the local-spec name; the
    other entries are aliases (Transformer Engine spec fuses layernorms into the next linear).
    """

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str
    checkpoint_key: Optional[str] = None
    """The key of this tensor (all layers, all experts) in `torch_dist` checkpoints; default: each
    megatron name without its `{i}.` (layers are stacked on a leading axis)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TensorRule.kind must be one of {KINDS}, got {self.kind!r}")
        want = 3 if self.kind == "qkv" else 2 if self.kind == "gate_up" else 1
        if len(self.hf) != want:
            raise ValueError(f"TensorRule({self.megatron[0]}): kind {self.kind!r} needs {want} HF tensors, got {self.hf}")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron[0]

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.megatron[0]

    def checkpoint_keys(self) -> list[str]:
        """Every key this tensor may have in a `torch_dist` checkpoint (local and TE spec)."""
        if self.checkpoint_key is not None:
            return [self.checkpoint_key]
        return list(dict.fromkeys(alias.replace("{i}.", "") for alias in self.megatron))


# --------------------------------------------------------------------------- transforms (full tensors)
def _qkv_split_sizes(info: ShapeInfo) -> tuple[int, int]:
    return info.num_attention_heads // info.num_query_groups * info.head_dim, info.head_dim


def hf_to_full(rule: TensorRule, hf: Sequence[torch.Tensor], info: ShapeInfo) -> torch.Tensor:
    """HF tensor(s) -> the full (TP=1 layout) megatron tensor of `rule`."""
    if rule.kind == "qkv":
        q, k, v = hf
        ng = info.num_query_groups
        rest = q.shape[1:]
        qg, kg = _qkv_split_sizes(info)
        parts = [q.reshape(ng, qg, *rest), k.reshape(ng, kg, *rest), v.reshape(ng, kg, *rest)]
        return torch.cat(parts, dim=1).reshape(ng * (qg + 2 * kg), *rest)
    if rule.kind == "gate_up":
        return torch.cat(list(hf), dim=0)
    (t,) = hf
    if rule.kind == "vocab":
        if t.shape[0] != info.vocab_size:
            raise ValueError(f"{rule.hf[0]}: {t.shape[0]} rows, expected vocab_size={info.vocab_size}")
        if info.padded_vocab_size > t.shape[0]:
            pad = t.new_zeros((info.padded_vocab_size - t.shape[0], *t.shape[1:]))
            t = torch.cat([t, pad], dim=0)
    return t


def full_to_hf(rule: TensorRule, full: torch.Tensor, info: ShapeInfo) -> list[torch.Tensor]:
    """The full (TP=1 layout) megatron tensor of `rule` -> its HF tensor(s), in `rule.hf` order."""
    if rule.kind == "qkv":
        ng = info.num_query_groups
        rest = full.shape[1:]
        qg, kg = _qkv_split_sizes(info)
        q, k, v = full.reshape(ng, qg + 2 * kg, *rest).split([qg, kg, kg], dim=1)
        return [x.reshape(ng * x.shape[1], *rest) for x in (q, k, v)]
    if rule.kind == "gate_up":
        return list(full.chunk(2, dim=0))
    if rule.kind == "vocab":
        return [full[: info.vocab_size]]
    return [full]


def shard(rule: TensorRule, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s part of a full megatron tensor."""
    if tp_size == 1 or rule.kind == "replicated":
        return full
    if rule.kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    dim = 1 if rule.kind == "row" and full.dim() > 1 else 0
    if full.shape[dim] % tp_size:
        raise ValueError(f"{rule.megatron[0]}: dim {dim} of shape {tuple(full.shape)} is not divisible by TP={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


def unshard(rule: TensorRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full megatron tensor from every TP rank's part (in TP-rank order)."""
    if len(shards) == 1 or rule.kind == "replicated":
        return shards[0]
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    dim = 1 if rule.kind == "row" and shards[0].dim() > 1 else 0
    return torch.cat(list(shards), dim=dim)


# --------------------------------------------------------------------------- families
@dataclass
class ModelMapping:
    """All tensors of one model family. `tied_hf` is the HF name dropped when embeddings are tied."""

    architecture: str
    rules: list[TensorRule]
    tied_megatron: str = "output_layer.weight"
    tied_hf: str = "lm_head.weight"
    ignored_hf: tuple[str, ...] = (r".*\.rotary_emb\.inv_freq$",)
    """Regexes of HF tensors that carry no weights (old checkpoints store RoPE buffers)."""
    write_tied_head: bool = False
    """Also write `tied_hf` (a copy of the embedding) when embeddings are tied. For families whose SGLang
    model ignores `tie_word_embeddings` (0.5.23's `qwen3_moe.py`): served from a checkpoint without it,
    the output head stays zero and every token gets -log(vocab). Every export (disk sync, distributed
    sync, offline conversion) writes it; transformers and the built-in server load it as the tied head."""
    _index: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for rule in self.rules:
            for name in rule.megatron:
                pattern = re.escape(name).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
                self._index[name] = (re.compile(pattern + "$"), rule)

    def match_megatron(self, name: str) -> Optional[tuple[TensorRule, Optional[int], Optional[int]]]:
        """(rule, layer index, LOCAL expert index) in a megatron parameter name (None where the rule
        has none), or None when no rule matches."""
        for pattern, rule in self._index.values():
            m = pattern.match(name)
            if m:
                groups = m.groupdict()
                layer, expert = groups.get("i"), groups.get("e")
                return rule, None if layer is None else int(layer), None if expert is None else int(expert)
        return None

    def rules_for(self, info: ShapeInfo) -> Iterator[tuple[TensorRule, Optional[int], Optional[int]]]:
        """Every (rule, layer, expert) of the whole model in HF order (embedding, layers with their
        experts, norm, head); layer / expert are None for rules without them."""
        glob = [r for r in self.rules if not r.per_layer]
        layer = [r for r in self.rules if r.per_layer]
        head = [r for r in glob if r.megatron[0] != "embedding.word_embeddings.weight"]
        emb = [r for r in glob if r.megatron[0] == "embedding.word_embeddings.weight"]
        for r in emb:
            yield r, None, None
        for i in range(info.num_layers):
            for r in layer:
                if r.per_expert:
                    for e in range(info.num_experts):
                        yield r, i, e
                else:
                    yield r, i, None
        for r in head:
            if info.tie_word_embeddings and r.megatron[0] == self.tied_megatron:
                continue
            yield r, None, None

    def hf_names(self, rule: TensorRule, layer: Optional[int], expert: Optional[int] = None) -> list[str]:
        fields = {"i": layer, "e": expert}
        return [n.format(**{k: v for k, v in fields.items() if "{" + k + "}" in n}) for n in rule.hf]

    def tied_head_copy(self, info: ShapeInfo) -> bool:
        """Whether exports of this model also write `tied_hf` as a copy of the embedding (`write_tied_head`)."""
        return bool(info.tie_word_embeddings and self.write_tied_head)

    def expected_hf_names(self, info: ShapeInfo) -> list[str]:
        return [n for r, i, e in self.rules_for(info) for n in self.hf_names(r, i, e)]

    def is_ignored_hf(self, name: str) -> bool:
        return any(re.match(p, name) for p in self.ignored_hf)


def as_dict(hf_config: Any) -> Mapping:
    return hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
