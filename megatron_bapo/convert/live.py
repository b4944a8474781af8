"""Live megatron-core model <-> HF weights: load an HF checkpoint into a (TP/PP-sharded) model,
iterate the model as HF-named full tensors (weight sync), and save it as an HF directory.

Layer indices: a model chunk names its layers `decoder.layers.<local j>`; the global index is
`layer.layer_number - 1`, which megatron sets from the pipeline (and virtual pipeline) offset.
Experts: a MoE layer names its experts by their index on this expert-parallel rank; the global
index is the layer's `local_expert_indices[e]`. Expert tensors split over the expert-tensor-parallel
group, and the experts of a layer live on the ranks of the expert-parallel group, so the gathers of
`iter_hf_tensors` run over those groups for them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_bapo.convert.families import get_mapping
from megatron_bapo.convert.hf_io import HFCheckpointReader, HFShardWriter, copy_tokenizer_files, write_config
from megatron_bapo.convert.mapping import ModelMapping, ShapeInfo, TensorRule, full_to_hf, hf_to_full, shard, unshard
from megatron_bapo.models.parallel import ParallelGroups, current_groups
from megatron_bapo.run_state import replace_dir

EMBEDDING_HF = "model.embed_tokens.weight"

logger = logging.getLogger(__name__)

Key = tuple[int, Optional[int], Optional[int]]
"""(rule position in the family's rule list, global layer index or None, global expert index or None)."""


def unwrap(chunk: Any):
    """The `GPTModel` inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    m = chunk
    while not isinstance(m, GPTModel):
        if not hasattr(m, "module"):
            raise TypeError(f"expected a megatron-core GPTModel (possibly wrapped), got {type(chunk).__name__}")
        m = m.module
    return m


def _vocab_divisible_by(model) -> int:
    """Recover the padding multiple the model was built with (its padded and HF vocab sizes)."""
    args = getattr(model, "model_args", None)
    if args is None:
        return 128
    padded, vocab = args.padded_vocab_size, args.vocab_size
    for d in (128, 64, 256, 512, 1024, 32, 16, 8, 4, 2, 1):
        if padded % d == 0 and padded - vocab < d:
            return d
    return 1


def model_shape_info(model_chunks: Sequence[Any], hf_config: Any) -> ShapeInfo:
    return ShapeInfo.from_hf_config(hf_config, vocab_divisible_by=_vocab_divisible_by(unwrap(model_chunks[0])))


def named_model_tensors(model_chunks: Sequence[Any], mapping: ModelMapping) -> Iterator[tuple[str, Key, TensorRule, torch.nn.Parameter]]:
    """(megatron name, key, rule, parameter) for every parameter of this rank's chunks.

    Raises naming any parameter the family's mapping does not know.
    """
    positions = {id(r): k for k, r in enumerate(mapping.rules)}
    for chunk in model_chunks:
        model = unwrap(chunk)
        layers = list(model.decoder.layers) if hasattr(model, "decoder") else []
        layer_number = {j: int(layer.layer_number) - 1 for j, layer in enumerate(layers)}
        for name, param in model.named_parameters():
            hit = mapping.match_megatron(name)
            if hit is None:
                raise KeyError(f"megatron parameter {name!r} has no HF mapping in {mapping.architecture}")
            rule, j, local_expert = hit
            layer = layer_number[j] if j is not None else None
            expert = None if local_expert is None else int(layers[j].mlp.local_expert_indices[local_expert])
            yield name, (positions[id(rule)], layer, expert), rule, param


def _tp(tp_group) -> tuple[Any, int, int]:
    group = tp_group if tp_group is not None else current_groups().tp_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _expert_groups(etp_group, ep_group) -> tuple[Any, int, int, Any, int, int]:
    """(etp group, rank, size, ep group, rank, size), defaults from megatron's parallel state."""
    if etp_group is None or ep_group is None:
        groups = current_groups()
        etp_group = etp_group if etp_group is not None else groups.etp_group
        ep_group = ep_group if ep_group is not None else groups.ep_group
    return (etp_group, dist.get_rank(etp_group), dist.get_world_size(etp_group),
            ep_group, dist.get_rank(ep_group), dist.get_world_size(ep_group))


def check_hf_names(mapping: ModelMapping, info: ShapeInfo, names: Sequence[str], source: str) -> None:
    """Raise naming the missing and unexpected HF tensors (an lm_head next to tied embeddings is fine)."""
    expected = set(mapping.expected_hf_names(info))
    have = set(names)
    missing = sorted(expected - have)
    unexpected = sorted(
        n for n in have - expected
        if not mapping.is_ignored_hf(n) and not (info.tie_word_embeddings and n == mapping.tied_hf)
    )
    if missing or unexpected:
        raise KeyError(
            f"{source} does not match {mapping.architecture} with {info.num_layers} layers: "
            f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}, "
            f"unexpected tensors {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )


@torch.no_grad()
def load_hf_into_model(
    model_chunks: Sequence[Any],
    hf_dir: str | os.PathLike,
    *,
    hf_config: Any = None,
    tp_group: Any = None,
    etp_group: Any = None,
) -> int:
    """Copy the weights of an HF safetensors checkpoint into this rank's model chunks.

    No communication: every rank reads (memory-mapped, one tensor at a time) only the HF tensors its
    TP/PP/EP position needs and keeps its TP part (its expert-TP part of its own experts).
    `hf_config` defaults to `<hf_dir>/config.json`; the TP (expert-TP) rank/size come from
    `tp_group` (`etp_group`), default: megatron's parallel_state. Tied embeddings also fill
    the last stage's `output_layer.weight` when PP > 1. Raises naming missing/unexpected tensors.

    After loading into an Actor whose optimizer keeps separate main (fp32) params, call
    `optimizer.reload_model_params()` so the optimizer sees the new weights.
    Returns the number of parameters loaded on this rank.
    """
    hf_dir = Path(hf_dir)
    if hf_config is None:
        hf_config = json.loads((hf_dir / "config.json").read_text())
    mapping = get_mapping(hf_config)
    info = model_shape_info(model_chunks, hf_config)
    _, tp_rank, tp_size = _tp(tp_group)
    if info.num_experts:
        _, etp_rank, etp_size, *_ = _expert_groups(etp_group, None)
    count = 0
    with HFCheckpointReader(hf_dir) as reader:
        check_hf_names(mapping, info, reader.names(), str(hf_dir))
        for name, (_, layer, expert), rule, param in named_model_tensors(model_chunks, mapping):
            hf_names = mapping.hf_names(rule, layer, expert)
            if info.tie_word_embeddings and rule.megatron[0] == mapping.tied_megatron:
                hf_names = [EMBEDDING_HF]  # the last stage's copy of the tied embedding
            full = hf_to_full(rule, [reader.get(n) for n in hf_names], info)
            rank, size = (etp_rank, etp_size) if rule.per_expert else (tp_rank, tp_size)
            part = shard(rule, full, rank, size)
            if tuple(part.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: HF {hf_names} give shape {tuple(part.shape)} on (expert-)TP rank {rank}/{size}, "
                    f"the model has {tuple(param.shape)} (does the config match the checkpoint?)"
                )
            param.data.copy_(part.to(param.dtype))
            count += 1
    logger.info("loaded %d tensors from %s (TP rank %d/%d)", count, hf_dir, tp_rank, tp_size)
    return count


def _full_shape(rule: TensorRule, local: torch.Size, tp_size: int) -> list[int]:
    shape = list(local)
    if tp_size > 1 and rule.kind != "replicated":
        dim = 1 if rule.kind == "row" and len(shape) > 1 else 0
        shape[dim] *= tp_size
    return shape


@torch.no_grad()
def iter_hf_tensors(
    model_chunks: Sequence[Any],
    hf_config: Any,
    *,
    bucket_bytes: int = 512 * 2**20,
    dtype: Optional[torch.dtype] = None,
    gather_to: str = "all",
    tp_group: Any = None,
    pp_group: Any = None,
    etp_group: Any = None,
    ep_group: Any = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the live model's weights as HF-named full tensors, in buckets of <= `bucket_bytes`.

    Collective: every rank of the model-parallel group (TP x PP, and with experts the expert-TP and
    expert-parallel groups) must iterate to the end, in step. TP parts are all-gathered over
    `tp_group` (expert parts over `etp_group`); each expert is broadcast from the expert-parallel
    rank holding it to its `ep_group`; across pipeline stages `gather_to` decides who gets what:
    "all" (broadcast: every rank yields every tensor), "first" (TP rank 0 of stage 0 yields every
    tensor; of every other stage only TP rank 0 sends its stage's tensors to it, once, and no other
    rank yields anything: the TP peers hold the same gathered tensors, and sending them too would
    move every later stage's weights TP times per sync), "local" (each stage yields only its own
    tensors, e.g. for per-stage NCCL weight sync). Order is HF order (embedding, layers with their experts, norm,
    head). Tensors are on the parameters' device, cast to `dtype` when given. A tensor larger than
    `bucket_bytes` is alone in its bucket. Different DP/CP replicas hold identical weights; run it on
    one replica (with expert parallelism: `ParallelGroups.exports_weights`) or on all.
    """
    if gather_to not in ("all", "first", "local"):
        raise ValueError(f"iter_hf_tensors: gather_to must be 'all', 'first' or 'local', got {gather_to!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"iter_hf_tensors: bucket_bytes must be > 0, got {bucket_bytes}")
    mapping = get_mapping(hf_config)
    info = model_shape_info(model_chunks, hf_config)
    tp_group, tp_rank, tp_size = _tp(tp_group)
    pp_group = pp_group if pp_group is not None else current_groups().pp_group
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    device = next(unwrap(model_chunks[0]).parameters()).device  # receive buffers: where the weights live
    ep_size = 1
    if info.num_experts:
        etp_group, _, etp_size, ep_group, ep_rank, ep_size = _expert_groups(etp_group, ep_group)
        num_local = info.num_experts // ep_size

    local: dict[Key, tuple[TensorRule, torch.nn.Parameter]] = {}
    meta: dict[Key, tuple[list[int], torch.dtype]] = {}
    for _, key, rule, param in named_model_tensors(model_chunks, mapping):
        if info.tie_word_embeddings and rule.megatron[0] == mapping.tied_megatron:
            continue  # the embedding (stage 0) is the HF tensor
        local[key] = (rule, param)
        entry = (_full_shape(rule, param.shape, etp_size if rule.per_expert else tp_size), dtype or param.dtype)
        if rule.per_expert:  # after the expert-parallel broadcast this stage holds every expert
            for e in range(info.num_experts):
                meta[(key[0], key[1], e)] = entry
        else:
            meta[key] = entry
    owners: dict[Key, int] = {k: pp_rank for k in meta}
    if pp_size > 1:
        gathered: list = [None] * pp_size
        dist.all_gather_object(gathered, {k: m for k, m in meta.items()}, group=pp_group)
        for stage, stage_meta in enumerate(gathered):
            for k, m in stage_meta.items():
                owners.setdefault(k, stage)
                meta.setdefault(k, m)
    positions = {id(r): k for k, r in enumerate(mapping.rules)}
    order = [(positions[id(r)], i, e) for r, i, e in mapping.rules_for(info)]
    missing = [mapping.hf_names(mapping.rules[p], i, e) for p, i, e in order if (p, i, e) not in owners]
    if missing:
        raise KeyError(f"iter_hf_tensors: no pipeline stage holds the tensors for {missing[:10]}")

    def empty_hf(key: Key) -> list[torch.Tensor]:
        full_shape, dt = meta[key]
        shapes = [t.shape for t in full_to_hf(mapping.rules[key[0]], torch.empty(full_shape, device="meta"), info)]
        return [torch.empty(s, dtype=dt, device=device) for s in shapes]

    def gathered_hf(key: Key) -> list[torch.Tensor]:
        """This stage's full HF tensors of `key` (TP / expert-TP gather, expert-parallel broadcast)."""
        rule = mapping.rules[key[0]]
        if rule.per_expert and ep_size > 1:
            owner = key[2] // num_local
            tensors = own_hf(key) if owner == ep_rank else empty_hf(key)
            for t in tensors:
                dist.broadcast(t, src=dist.get_global_rank(ep_group, owner), group=ep_group)
            return tensors
        return own_hf(key)

    def own_hf(key: Key) -> list[torch.Tensor]:
        rule, param = local[key]
        group, size = (etp_group, etp_size) if rule.per_expert else (tp_group, tp_size)
        data = param.detach().to(meta[key][1]).contiguous()
        if size > 1:
            parts = [torch.empty_like(data) for _ in range(size)]
            dist.all_gather(parts, data, group=group)
        else:
            parts = [data]
        return [t.contiguous() for t in full_to_hf(rule, unshard(rule, parts), info)]

    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    embedding: Optional[torch.Tensor] = None  # kept for the tied head's copy (`mapping.write_tied_head`)
    for key in order:
        rule = mapping.rules[key[0]]
        names = mapping.hf_names(rule, key[1], key[2])
        owner = owners[key]
        tensors: Optional[list[torch.Tensor]] = None
        if owner == pp_rank:
            tensors = gathered_hf(key)
        if gather_to == "first" and (pp_rank != 0 or tp_rank != 0):
            # One sender per stage: only TP rank 0 of a later stage sends, to TP rank 0 of stage 0
            # (ranks of one pipeline group share their TP rank, so both ends agree on who moves).
            if pp_size > 1 and tp_rank == 0 and owner == pp_rank and owner != 0:
                for t in tensors or []:
                    dist.send(t, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
            continue
        if pp_size > 1 and gather_to != "local" and owner != pp_rank:
            tensors = empty_hf(key)
            src = dist.get_global_rank(pp_group, owner)
            for t in tensors:
                if gather_to == "all":
                    dist.broadcast(t, src=src, group=pp_group)
                else:  # "first", on TP rank 0 of stage 0
                    dist.recv(t, src=src, group=pp_group)
        elif pp_size > 1 and gather_to == "all":
            for t in tensors or []:
                dist.broadcast(t, src=dist.get_global_rank(pp_group, owner), group=pp_group)
        named = list(zip(names, tensors or []))
        if mapping.tied_head_copy(info) and names == [EMBEDDING_HF] and named:
            embedding = named[0][1]
        if mapping.tied_head_copy(info) and key is order[-1] and embedding is not None:
            named.append((mapping.tied_hf, embedding.clone()))  # HF order: the head comes last
        for n, t in named:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((n, t))
            size += nbytes
    if bucket:
        yield bucket


def save_model_as_hf(
    model_chunks: Sequence[Any],
    hf_config: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_src: Optional[str | os.PathLike] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = True,
    parallel: Optional[ParallelGroups] = None,
) -> Optional[Path]:
    """Write the live model as an HF directory (sharded safetensors, index, config, tokenizer files).

    Collective over every rank of `parallel` (the actor's `ParallelGroups`; default: megatron's
    current state). Only the first data/context-parallel replica gathers (over its TP/PP groups, and
    with expert parallelism together with the ranks holding the first copy of the other experts:
    `ParallelGroups.exports_weights`); the rank with TP = PP = DP = CP rank 0 writes `<out_dir>.tmp`
    and renames it to `out_dir` when complete (an existing `out_dir` is replaced when `overwrite`,
    otherwise FileExistsError), so a reader never sees a partial directory.
    `hf_config` (PretrainedConfig or dict) goes to config.json with `dtype`; `tokenizer_src` is an HF
    directory whose tokenizer/generation files are copied. Returns the path on the writer, else None.
    """
    parallel = parallel or current_groups()
    group = parallel.world_group
    out = Path(out_dir).absolute()
    first_replica = parallel.dp_rank == 0 and parallel.cp_rank == 0
    writer_rank = first_replica and parallel.tp_rank == 0 and parallel.pp_rank == 0
    error: Optional[BaseException] = None
    if writer_rank and out.exists() and not overwrite:
        error = FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    # On the group's own device: an NCCL group cannot reduce a CPU tensor.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)  # every rank learns about the failure instead of hanging
    if int(flag.item()):
        raise error or RuntimeError(f"save_model_as_hf: the writer rank refused to write {out}")
    tmp = out.with_name(out.name + ".tmp")
    written = None
    failed: Optional[BaseException] = None  # the writer's write failure (a full disk): raised after the gathers
    if parallel.exports_weights:
        writer = None
        if writer_rank:
            if tmp.exists():
                shutil.rmtree(tmp)
            writer = HFShardWriter(tmp, max_shard_bytes=max_shard_bytes, dtype=dtype)
        bucket_bytes = max(min(max_shard_bytes, 512 * 2**20), 1)
        buckets = iter_hf_tensors(model_chunks, hf_config, bucket_bytes=bucket_bytes, dtype=dtype, gather_to="first",
                                  tp_group=parallel.tp_group, pp_group=parallel.pp_group,
                                  etp_group=parallel.etp_group, ep_group=parallel.ep_group)
        for bucket in buckets:  # every rank keeps joining the gathers, also after the writer failed
            if writer is not None and failed is None:
                try:
                    writer.add_all(bucket)
                except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
                    failed = exc
        if writer is not None and failed is None:
            try:
                writer.close()
                if dtype is None:
                    dtype = next(unwrap(model_chunks[0]).parameters()).dtype
                write_config(hf_config, tmp, dtype=dtype)
                if tokenizer_src is not None:
                    copy_tokenizer_files(tokenizer_src, tmp)
                replace_dir(tmp, out)
                written = out
                logger.info("saved HF checkpoint to %s", out)
            except Exception as exc:  # noqa: BLE001
                failed = exc
    flag = torch.tensor([1 if failed is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)  # every rank stops, or none (the partial `<out>.tmp` is the caller's)
    if failed is not None:
        raise failed
    if int(flag.item()):
        raise OSError(errno.EIO, f"the writing rank could not write {out} (its error is in rank 0's log)")
    return written
