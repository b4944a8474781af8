"""What a checkpoint records about the run that wrote it, and what a resume compares.

    record = describe(config, hf_config, world_size=...)    # at start; saved in trainer.json as "run"
    notes = check_resume(saved_record, record, ckpt)         # at resume: raises CheckpointError, or
                                                             # returns the changes it honours (logged)

A resume continues the checkpoint's run exactly: the data position indexes the saved prompt list,
the partial-rollout buffer holds groups of the saved size, the actor's weights and optimizer state
have the saved shapes and layout. What megatron reshards on load (TP, PP, VPP, CP, DP: the checkpoint
is saved in a reshardable format) is allowed and logged. What a resume cannot honour is refused
before anything is built, in one `checkpoint error:` line naming each field with its old and new
value and the ways out (`--no-resume`, or a new `trainer.output_dir`):

- the data file: its size and a sha256 of its first and last MiB (a different file with the same
  number of rows would otherwise resume silently, and every saved index would name another prompt;
  the same content at another path is fine), and the data settings that decide the prompt list;
- `rollout.group_size` and `rollout.prompts_per_step` (the buffer's groups and the rounds' shape);
- the model's architecture and shapes, as megatron builds them (layers, widths, heads, padded vocab);
- the optimizer's layout: `actor.use_distributed_optimizer` and `actor.optim.name`.

It also records the machine (`machine_record`: CPU model, vendor, cores, torch's CPU kernels), which
a resume only notes when it changed: the same seeds give other numbers on another CPU kind (matmul and
reduction kernels differ by instruction set), so two runs' numbers are compared knowing where each ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Optional

from megatron_bapo.resume_policy import APPLIED, PATH_FIELDS, POLICY, REFUSED, SILENT

DATA_PROBE_BYTES = 1 << 20
"""Bytes hashed at each end of the data file: a different file is caught without reading all of it."""
DATA_KEYS = ("prompt_key", "answer_key", "apply_chat_template", "system_prompt", "max_prompt_tokens", "max_rows")
"""`data.*` fields that decide which rows become prompts (and so what a saved position points at)."""
MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
              "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "vocab_size", "position_embedding_type",
              "rotary_base", "share_embeddings_and_output_weights")
"""megatron-core `TransformerConfig` / `GPTModel` arguments that fix the weights' shapes and meaning
(`vocab_size` is the padded one)."""
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "dp")
MACHINE_KEYS = ("cpu_model", "cpu_vendor", "torch_cpu_capability", "torch_version")
"""`machine_record()` fields whose change a resume notes: the CPU kind and torch's kernels."""
WAY_OUT = ("put the setting(s) back to resume, or start over from model.hf_path with --no-resume "
           "(trainer.resume=false) or a new trainer.output_dir")


def data_fingerprint(path: str | Path) -> dict[str, Any]:
    """Identity of a data file: its absolute path, size and the sha256 of its first and last
    `DATA_PROBE_BYTES` (the whole file when smaller)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(DATA_PROBE_BYTES))
        if size > DATA_PROBE_BYTES:
            f.seek(max(size - DATA_PROBE_BYTES, DATA_PROBE_BYTES))
            digest.update(f.read())
    return {"path": str(path.absolute()), "size": size, "sha256_head_tail": digest.hexdigest()}


WEIGHT_PROBE_TENSORS = 3
WEIGHT_PROBE_BYTES = 1 << 20


def weights_fingerprint(hf_path: str | Path) -> dict[str, Any]:
    """Identity of the initial weights in `hf_path`, cheap at any size: the names, dtypes and shapes
    of every tensor (from the safetensors headers) and the sha256 of the first and last
    `WEIGHT_PROBE_BYTES` of `WEIGHT_PROBE_TENSORS` tensors (the first, middle and last by name).
    Two models of the same shapes (another seed, another fine-tune) differ in those bytes; the same
    files copied elsewhere do not. Without safetensors (a `.bin` checkpoint) the head and tail of
    each weight file are hashed instead."""
    import struct

    root = Path(hf_path)
    files = sorted(root.glob("*.safetensors"))
    digest = hashlib.sha256()
    if not files:
        files = sorted(root.glob("*.bin")) + sorted(root.glob("*.pt"))
        for path in files:
            digest.update(path.name.encode())
            digest.update(data_fingerprint(path)["sha256_head_tail"].encode())
        return {"sha256": digest.hexdigest(), "num_tensors": None, "files": len(files)}
    tensors: dict[str, tuple[Path, int, dict]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            tensors[name] = (path, 8 + size, entry)
    names = sorted(tensors)
    for name in names:
        entry = tensors[name][2]
        digest.update(f"{name}:{entry['dtype']}:{entry['shape']};".encode())
    probes = sorted({names[0], names[len(names) // 2], names[-1]}) if names else []
    for name in probes[:WEIGHT_PROBE_TENSORS]:
        path, base, entry = tensors[name]
        start, end = (base + int(x) for x in entry["data_offsets"])
        with open(path, "rb") as f:
            f.seek(start)
            digest.update(f.read(min(WEIGHT_PROBE_BYTES, end - start)))
            if end - start > WEIGHT_PROBE_BYTES:
                f.seek(max(end - WEIGHT_PROBE_BYTES, start + WEIGHT_PROBE_BYTES))
                digest.update(f.read(end - f.tell()))
    return {"sha256": digest.hexdigest(), "num_tensors": len(names), "probed": probes}


MACHINE_HEADER = "# machine: "
"""Prefix of config.yaml's comment line that holds `machine_record()` as JSON (a comment: the file
stays a config that `--config` loads)."""


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux); {} elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def machine_record() -> dict[str, Any]:
    """Where this process runs, as far as it changes the numbers: the CPU model and vendor (from
    /proc/cpuinfo, else `platform`), its logical cores (all, and those this process may use), and the
    CPU kernels torch dispatches to (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2, ...;
    `ATEN_CPU_CAPABILITY` in the environment lowers it), with torch's version and thread count."""
    import torch

    info = _cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_model": info.get("model name") or platform.processor() or platform.machine() or "unknown",
        "cpu_vendor": info.get("vendor_id") or info.get("CPU implementer") or platform.machine() or "unknown",
        "num_cpus": os.cpu_count(),
        "num_cpus_usable": usable,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }


def describe_machine(machine: Optional[dict[str, Any]]) -> str:
    """One line for logs and summaries: "Intel(R) Xeon(R) Processor (GenuineIntel, 2 cpus), torch
    2.13.0+cpu, CPU capability AVX512"; "unknown (not recorded)" for None."""
    if not machine:
        return "unknown (not recorded)"
    forced = machine.get("aten_cpu_capability_env")
    return (f"{machine.get('cpu_model')} ({machine.get('cpu_vendor')}, {machine.get('num_cpus')} cpus), torch "
            f"{machine.get('torch_version')}, CPU capability {machine.get('torch_cpu_capability')}"
            + (f" (ATEN_CPU_CAPABILITY={forced})" if forced else ""))


def machine_header() -> str:
    """config.yaml's first line: `MACHINE_HEADER` + `machine_record()` as JSON, newline-terminated."""
    return MACHINE_HEADER + json.dumps(machine_record()) + "\n"


def read_machine_header(text: str) -> Optional[dict[str, Any]]:
    """The machine record from a config.yaml's `machine_header()` line; None when it has none."""
    for line in text.splitlines():
        if line.startswith(MACHINE_HEADER):
            try:
                return json.loads(line[len(MACHINE_HEADER):])
            except json.JSONDecodeError:
                return None
    return None


def config_record(config: Any) -> dict[str, Any]:
    """The resolved config as `{dotted field: value}`, JSON-safe, the API keys left out."""
    from megatron_bapo.config_io import to_dict
    from megatron_bapo.resume_policy import flatten

    flat = flatten(json.loads(json.dumps(to_dict(config))))
    for section in ("rollout", "teacher", "judge"):
        flat.pop(f"{section}.client.api_key", None)
    flat.pop("reward.judge.api_key", None)
    return flat


def describe(config: Any, hf_config: Any, *, world_size: int) -> dict[str, Any]:
    """The record of this run (JSON-safe): see the module docstring for what and why."""
    from megatron_bapo.models.registry import model_args_from_hf

    args = model_args_from_hf(hf_config, vocab_divisible_by=config.actor.vocab_divisible_by)
    shapes = {**args.config_kwargs, **args.gpt_kwargs}
    par = config.actor.parallel
    record = {
        "data": {**data_fingerprint(config.data.path), **{k: getattr(config.data, k) for k in DATA_KEYS}},
        "rollout": {"group_size": config.rollout.group_size, "prompts_per_step": config.rollout.prompts_per_step},
        "model": {"architecture": args.architecture, **{k: shapes[k] for k in MODEL_KEYS if k in shapes}},
        "optimizer": {"distributed": config.actor.use_distributed_optimizer, "name": config.actor.optim.name},
        "layout": {"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "cp": par.cp,
                   "dp": world_size // (par.tp * par.pp * par.cp)},
        "weights": {"path": str(Path(config.model.hf_path).absolute()), **weights_fingerprint(config.model.hf_path)},
        "config": config_record(config),
        "machine": machine_record(),
    }
    return json.loads(json.dumps(record))


_LAYOUT_FIELDS = tuple(f"actor.parallel.{k}" for k in ("tp", "pp", "cp", "vpp"))


def _changed_fields(old: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (old, new)} for every field whose recorded value differs (fields the checkpoint did
    not record, added since, are not listed)."""
    if not old:
        return {}
    return {k: (old[k], v) for k, v in new.items() if k in old and old[k] != v}


def check_resume(saved: Optional[dict[str, Any]], current: dict[str, Any], ckpt: str | Path) -> list[str]:
    """Compare the record saved with checkpoint `ckpt` with this run's; raise `CheckpointError`
    naming every change a resume cannot honour, else return the honoured changes (to log)."""
    from megatron_bapo.run_state import CheckpointError

    if not saved:
        return [f"{Path(ckpt).name} was written before checkpoints recorded their run: data file, group size, "
                f"model and optimizer layout are not checked"]
    refused, notes = [], []
    old, new = saved.get("data", {}), current["data"]
    if (old.get("size"), old.get("sha256_head_tail")) != (new["size"], new["sha256_head_tail"]):
        refused.append(f"data.path: {new['path']} ({new['size']} bytes) is not the file the checkpoint was trained on "
                       f"({old.get('path')}, {old.get('size')} bytes; the saved data position would point at other "
                       f"prompts)")
    elif old.get("path") != new["path"]:
        notes.append(f"data file moved: {old.get('path')} -> {new['path']} (same size and content)")
    for key in DATA_KEYS:
        if key in old and old[key] != new[key]:
            refused.append(f"data.{key} {old[key]!r} -> {new[key]!r} (changes the prompt list)")
    for key, value in current["rollout"].items():
        if key in saved.get("rollout", {}) and saved["rollout"][key] != value:
            refused.append(f"rollout.{key} {saved['rollout'][key]} -> {value} (the partial-rollout buffer and the "
                           f"rounds produced ahead hold the old shape)")
    old_model, new_model = saved.get("model", {}), current["model"]
    changed = [k for k in new_model if k in old_model and old_model[k] != new_model[k]]
    if changed:
        diffs = ", ".join(f"{k} {old_model[k]} -> {new_model[k]}" for k in changed)
        refused.append(f"model.hf_path: another architecture or shape than the checkpoint's weights ({diffs})")
    old_weights, new_weights = saved.get("weights"), current["weights"]
    if old_weights and not changed and old_weights.get("sha256") != new_weights["sha256"]:
        refused.append(f"model.hf_path: {new_weights['path']} holds other weights than the model this run started "
                       f"from ({old_weights.get('path')}; fingerprint {str(old_weights.get('sha256'))[:12]} -> "
                       f"{new_weights['sha256'][:12]}), so the checkpoint's weights would silently replace them")
    elif old_weights and old_weights.get("path") != new_weights["path"]:
        notes.append(f"model moved: {old_weights.get('path')} -> {new_weights['path']} (same weights)")
    names = {"distributed": "actor.use_distributed_optimizer", "name": "actor.optim.name"}
    for key, field in names.items():
        old_value = saved.get("optimizer", {}).get(key)
        if old_value is not None and old_value != current["optimizer"][key]:
            refused.append(f"{field} {old_value} -> {current['optimizer'][key]} (the saved optimizer state has "
                           f"another layout)")
    changed_fields = _changed_fields(saved.get("config"), current["config"])
    reported = {r.split(" ", 1)[0].rstrip(":") for r in refused}
    for name, (old_value, new_value) in changed_fields.items():
        kind, how = POLICY[name] if name in POLICY else (APPLIED, "not recorded by this version's table")
        if name in PATH_FIELDS or name in SILENT or name in _LAYOUT_FIELDS:
            continue  # by content above, changed by nature, or the one layout line below
        if kind == REFUSED:
            if name not in reported:
                refused.append(f"{name} {old_value!r} -> {new_value!r} ({how})")
        else:
            notes.append(f"{name} {old_value!r} -> {new_value!r} ({how})")
    if refused:
        raise CheckpointError(f"cannot resume from {ckpt}: " + "; ".join(refused) + f". {WAY_OUT}")
    if saved.get("config") is None:
        notes.append(f"{Path(ckpt).name} was written before checkpoints recorded their config: changed settings "
                     f"are applied without a line each")
    old_machine, new_machine = saved.get("machine"), current.get("machine")
    if old_machine and new_machine and any(old_machine.get(k) != new_machine.get(k) for k in MACHINE_KEYS):
        notes.append(f"machine {describe_machine(old_machine)} -> {describe_machine(new_machine)}: other CPU "
                     f"kernels, so the resumed steps' numbers differ from what the same seeds gave there")
    old_layout = saved.get("layout", {})
    if old_layout and any(old_layout.get(k) != current["layout"][k] for k in LAYOUT_KEYS):
        def show(layout: dict) -> str:
            return " ".join(f"{k.upper()}{layout.get(k)}" for k in LAYOUT_KEYS if layout.get(k) is not None)
        notes.append(f"layout {show(old_layout)} -> {show(current['layout'])}: megatron reshards the model and "
                     f"optimizer state on load (RNG streams restart)")
    return notes
