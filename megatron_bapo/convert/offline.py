"""Offline HF directory <-> megatron-core `torch_dist` checkpoint, streaming one tensor at a time.

Megatron checkpoint layout written by `hf_to_megatron(hf_dir, out_dir)`:
    <out>/                 megatron dist_checkpointing (`torch_dist`): metadata.json, common.pt,
                           __0_0.distcp, .metadata; keys are the GPTModel's `sharded_state_dict()`
                           keys (layers stacked on a leading axis), so any TP/PP/VPP layout loads it
    <out>/actor_meta.json  what `Actor.load_checkpoint(out, load_optimizer=False)` needs
    <out>/hf_template/     config.json + tokenizer files of the source (used by the way back)
The same keys are what `Actor.save_checkpoint` writes, so `megatron_to_hf` also exports actor
checkpoints (optimizer entries are ignored).

Why streaming works: to-megatron plans the save from a model built on the `meta` device (shapes,
keys, extra-state objects, no memory) and a save planner that materialises each tensor from the HF
files only when torch.distributed.checkpoint writes it. To-HF loads one (key, layer) slice per
`dist_checkpointing.load` call. Peak RAM ~ the largest fused tensor (plus one output shard).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_bapo.convert.families import get_mapping
from megatron_bapo.convert.hf_io import HFCheckpointReader, HFShardWriter, copy_tokenizer_files, write_config
from megatron_bapo.convert.live import check_hf_names
from megatron_bapo.convert.mapping import ModelMapping, ShapeInfo, TensorRule, full_to_hf, hf_to_full
from megatron_bapo.run_state import replace_dir

logger = logging.getLogger(__name__)
TEMPLATE = "hf_template"
ACTOR_META = "actor_meta.json"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def ensure_single_process_groups() -> None:
    """A world of one process with megatron's TP=PP=1 groups (dist_checkpointing needs a process group)."""
    from megatron_bapo.models.parallel import ParallelConfig, init_distributed_env, initialize_model_parallel

    if not dist.is_initialized():
        init_distributed_env()
    initialize_model_parallel(ParallelConfig(backend="gloo"), seed=0)
    if dist.get_world_size() != 1:
        raise RuntimeError("offline conversion runs in one process (world size 1)")


def _sharded_key_rules(mapping: ModelMapping) -> dict[str, TensorRule]:
    """Checkpoint key (layers stacked, experts stacked) -> rule, for every alias."""
    return {key: rule for rule in mapping.rules for key in rule.checkpoint_keys()}


def _meta_model(hf_config: Any, dtype: torch.dtype, vocab_divisible_by: int):
    from megatron.core.models.gpt import GPTModel

    from megatron_bapo.models.builder import transformer_config_from_hf
    from megatron_bapo.models.layer_spec import get_layer_spec, spec_options

    config, args = transformer_config_from_hf(
        hf_config, dtype=dtype, vocab_divisible_by=vocab_divisible_by,
        use_cpu_initialization=True, perform_initialization=False,
    )
    with torch.device("meta"):
        model = GPTModel(
            config=config, transformer_layer_spec=get_layer_spec(use_te=False, **spec_options(config)), pre_process=True,
            post_process=True, parallel_output=True, **args.gpt_kwargs,
        )
    return model


class _FullTensorCache:
    """The full (TP=1 layout) megatron tensor of the last (rule, layer, expert) asked for."""

    def __init__(self, produce: Callable[[TensorRule, Optional[int], Optional[int]], torch.Tensor]) -> None:
        self.produce = produce
        self.key: Any = None
        self.value: Optional[torch.Tensor] = None

    def get(self, rule: TensorRule, layer: Optional[int], expert: Optional[int] = None) -> torch.Tensor:
        if self.key != (id(rule), layer, expert):
            self.value = None  # drop the previous tensor before reading the next
            self.value = self.produce(rule, layer, expert)
            self.key = (id(rule), layer, expert)
        return self.value


def _lazy_planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyHFSavePlanner(MCoreSavePlanner):
        """Plans from meta tensors; `resolve_data` builds each chunk from the HF files on demand."""

        def __init__(self, resolve_chunk, **kwargs) -> None:
            super().__init__(**kwargs)
            self.resolve_chunk = resolve_chunk

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            return self.resolve_chunk(
                write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes), write_item.tensor_data.properties.dtype
            )

    return LazyHFSavePlanner


def _lazy_strategy(resolve_chunk):
    """A `torch_dist` save strategy (same files and metadata as megatron's) with lazy tensor data."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    planner_cls = _lazy_planner_class()

    class LazyTorchDistStrategy(SaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt = mcore_to_pyt_state_dict(flat, False)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1)
            dcp_save(pyt, storage_writer=writer, planner=planner_cls(resolve_chunk, flatten_state_dict=False))

    return LazyTorchDistStrategy()


def _prepare_out(out_dir: Path, force: bool) -> Path:
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass --force (force=True) to overwrite it")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


def _parse_dtype(dtype: Any) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: Any = None,
    vocab_divisible_by: int = 128,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Convert an HF safetensors directory into a reshardable megatron-core `torch_dist` checkpoint.

    dtype: "bfloat16"/"float32"/... or a torch dtype; default the HF embedding's dtype. The output
    is written to `<out_dir>.tmp` and renamed when complete; an existing `out_dir` needs `force`.
    Raises naming missing/unexpected HF tensors and unknown architectures. Returns `out_dir`.
    """
    from megatron.core import dist_checkpointing

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    hf_config = json.loads((hf_dir / "config.json").read_text())
    mapping = get_mapping(hf_config)
    info = ShapeInfo.from_hf_config(hf_config, vocab_divisible_by=vocab_divisible_by)
    reader = HFCheckpointReader(hf_dir)
    check_hf_names(mapping, info, reader.names(), str(hf_dir))
    dtype = _parse_dtype(dtype) or reader.get("model.embed_tokens.weight").dtype
    tmp = _prepare_out(out_dir, force)
    ensure_single_process_groups()
    model = _meta_model(hf_config, dtype, vocab_divisible_by)
    rules = _sharded_key_rules(mapping)
    cache = _FullTensorCache(lambda r, i, e: hf_to_full(r, [reader.get(n) for n in mapping.hf_names(r, i, e)], info))
    bar = _progress(sum(1 for _ in model.parameters()), "HF -> megatron", progress)

    def resolve_chunk(key: str, offsets: tuple, sizes: tuple, want: torch.dtype) -> torch.Tensor:
        if key not in rules:
            raise KeyError(f"checkpoint key {key!r} has no HF mapping in {mapping.architecture}")
        rule = rules[key]
        stacked = int(rule.per_layer) + int(rule.per_expert)  # leading layer (and expert) axes, one each
        if any(s != 1 for s in sizes[:stacked]):
            raise ValueError(f"{key}: a chunk spans several layers or experts ({sizes[:stacked]})")
        layer = offsets[0] if rule.per_layer else None
        expert = offsets[1] if rule.per_expert else None
        offsets, sizes = offsets[stacked:], sizes[stacked:]
        if info.tie_word_embeddings and rule.megatron[0] == mapping.tied_megatron:
            rule, layer = rules["embedding.word_embeddings.weight"], None
        full = cache.get(rule, layer, expert)
        if tuple(offsets) == (0,) * full.dim() and tuple(sizes) == tuple(full.shape):
            bar.update(1)
        out = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        out = out.to(want).contiguous()
        return out.reshape((1,) * stacked + tuple(out.shape))

    try:
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp), sharded_strategy=_lazy_strategy(resolve_chunk))
    finally:
        bar.close()
        reader.close()
    template = tmp / TEMPLATE
    template.mkdir()
    shutil.copy2(hf_dir / "config.json", template / "config.json")
    copy_tokenizer_files(hf_dir, template)
    meta = {
        "layout": {"tp": 1, "pp": 1, "cp": 1, "vpp": None, "dp": 1}, "world_size": 1, "num_updates": 0,
        "num_skipped_steps": 0, "distributed_optimizer": False, "converted_from_hf": str(hf_dir.absolute()),
        "dtype": str(dtype).replace("torch.", ""), "vocab_divisible_by": vocab_divisible_by,
    }
    (tmp / ACTOR_META).write_text(json.dumps(meta, indent=2))
    replace_dir(tmp, out_dir)
    logger.info("wrote megatron checkpoint %s from %s", out_dir, hf_dir)
    return out_dir


def megatron_to_hf(
    megatron_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_template: Optional[str | os.PathLike] = None,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Convert a megatron `torch_dist` checkpoint (converted or saved by the Actor) into an HF directory.

    hf_template: HF directory whose config.json and tokenizer files are used; default
    `<megatron_dir>/hf_template` (written by `hf_to_megatron`). dtype: default the checkpoint's.
    Reads one (tensor, layer) at a time; output shards hold at most `max_shard_bytes`.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    mdir, out_dir = Path(megatron_dir).absolute(), Path(out_dir).absolute()
    template = Path(hf_template) if hf_template is not None else mdir / TEMPLATE
    if not (template / "config.json").is_file():
        raise FileNotFoundError(
            f"{template}/config.json not found: pass --hf-template (hf_template=) with the model's HF config and tokenizer"
        )
    if not (mdir / "metadata.json").is_file():
        raise FileNotFoundError(f"{mdir} is not a megatron dist_checkpointing directory (no metadata.json)")
    hf_config = json.loads((template / "config.json").read_text())
    mapping = get_mapping(hf_config)
    ensure_single_process_groups()
    tensors_meta = dist_checkpointing.load_tensors_metadata(str(mdir))
    model_keys = {k: v for k, v in tensors_meta.items() if k.startswith(MODEL_PREFIXES)}
    emb = model_keys.get("embedding.word_embeddings.weight")
    if emb is None:
        raise KeyError(f"{mdir}: no 'embedding.word_embeddings.weight' (keys: {sorted(model_keys)[:10]})")
    info = ShapeInfo.from_hf_config(hf_config, vocab_divisible_by=int(emb.global_shape[0]))
    rules = _sharded_key_rules(mapping)
    unknown = sorted(k for k in model_keys if k not in rules)
    missing = sorted({r.checkpoint_keys()[-1] for r, _, _ in mapping.rules_for(info)
                      if not any(k in model_keys for k in r.checkpoint_keys())})
    if unknown or missing:
        raise KeyError(f"{mdir} does not match {mapping.architecture}: missing tensors {missing}, unexpected tensors {unknown}")
    key_of = {id(r): next(k for k in r.checkpoint_keys() if k in model_keys) for r, _, _ in mapping.rules_for(info)}
    out_dtype = _parse_dtype(dtype) or emb.dtype  # one dtype for every tensor (norms may be stored fp32)
    tmp = _prepare_out(out_dir, force)
    order = list(mapping.rules_for(info))
    writer = HFShardWriter(tmp, max_shard_bytes=max_shard_bytes, dtype=out_dtype)
    with _progress(len(order), "megatron -> HF", progress) as bar:
        cached: tuple = (None, None)  # ((rule id, layer), that layer's experts [E, ...]): one read per layer
        for rule, layer, expert in order:
            key = key_of[id(rule)]
            gshape = tuple(model_keys[key].global_shape)
            meta_dtype = model_keys[key].dtype
            if rule.per_layer:
                if gshape[0] != info.num_layers:
                    raise ValueError(f"{key}: {gshape[0]} layers in the checkpoint, config says {info.num_layers}")
                if rule.per_expert and gshape[1] != info.num_experts:
                    raise ValueError(f"{key}: {gshape[1]} experts in the checkpoint, config says {info.num_experts}")
                if rule.per_expert and cached[0] == (id(rule), layer):
                    full = cached[1][expert]
                else:
                    # One layer as a (1, ...) slice without a prepended axis: a partial read that needs no
                    # global shard grid (the prepend-axis form would ask torch for every layer's shard).
                    data = torch.empty((1,) + gshape[1:], dtype=meta_dtype)
                    sh = ShardedTensor.from_rank_offsets(key, data, (0, layer, gshape[0]), replica_id=0)
                    # a partial read on purpose: skip the "every shard read exactly once" check
                    full = dist_checkpointing.load({"t": sh}, str(mdir), validate_access_integrity=False)["t"][0]
                    if rule.per_expert:
                        cached = ((id(rule), layer), full)
                        full = full[expert]
            else:
                sh = ShardedTensor.from_rank_offsets(key, torch.empty(gshape, dtype=meta_dtype), replica_id=0)
                full = dist_checkpointing.load({"t": sh}, str(mdir), validate_access_integrity=False)["t"]
            for name, t in zip(mapping.hf_names(rule, layer, expert), full_to_hf(rule, full, info)):
                writer.add(name, t)
                if name == "model.embed_tokens.weight" and mapping.tied_head_copy(info):
                    writer.add(mapping.tied_hf, t)  # SGLang's model for this family needs the head
            bar.update(1)
    writer.close()
    write_config(hf_config, tmp, dtype=out_dtype)
    copy_tokenizer_files(template, tmp)
    replace_dir(tmp, out_dir)
    logger.info("wrote HF checkpoint %s from %s", out_dir, mdir)
    return out_dir
