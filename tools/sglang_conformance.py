"""Check recorded requests against the REAL sglang package's own request definitions.

    .venv-sglang/bin/python tools/sglang_conformance.py --records requests.jsonl --vocab-size 256

Runs in the separate environment `tools/install.sh` makes (`.venv-sglang`: the pinned `sglang`
installed with `--no-deps`, plus msgspec, pydantic and the CPU torch its sampling module imports;
never a CUDA build). It reads a JSONL file of recorded HTTP requests (one object per line: `method`,
`path`, `query`, `body`, `status`, `reply`, in the order they were sent to one server) and prints a
JSON report `{"sglang": version, "checked": n, "violations": [...]}`; the exit status is 1 when
there are violations.

What is SGLang's own judgment here, read from the installed package files:
- the route table: the `@app.get/post/put/api_route` decorators of `srt/entrypoints/http_server.py`
  and its included routers, read with `ast` (importing the module loads CUDA kernels);
- `/generate`: the HTTP contract gate 0.5.23 applies first (`sglang.api.v1.api_types.GenerateRequest`,
  the schema both the Python and the Rust server use), the fields of `GenerateReqInput`, then what
  the tokenizer manager does with `sampling_params`: `SamplingParams(**params)`, `.normalize(None)`,
  `.verify(vocab_size)`;
- every other body: the handler's request class from `srt/managers/io_struct.py` (found by the
  handler's annotation), validated as FastAPI does (pydantic, through the class's own
  `__get_pydantic_core_schema__`). `io_struct.py` imports the whole runtime (schedule_batch, model
  configs, torchvision, triton), so its request classes and type aliases are executed from its
  source by name, with the real sglang modules they use; nothing is replaced by a stand-in: a class
  that needs more fails loudly.
And the protocol rules of the pinned version, from its scheduler and tokenizer manager (see
`SESSION_RULES` below): distributed updates only inside a begin/end weight-update session; no cache
flush (explicit or an update's default `flush_cache: true`) while paused in place; `sampling_seed`
only when the server runs with `--enable-deterministic-inference` (it is ignored otherwise);
`return_routed_experts` only when it runs with `--enable-return-routed-experts` (ignored otherwise: no
routing comes back) and with `routed_experts_start_len` in `[0, len(input_ids)]` (refused otherwise).
`logprob_start_len` (a prefill's input log-probs: `rollout.prefill`) only with `return_logprob` (reset to
-1 otherwise) and in `[0, len(input_ids)]` (`Scheduler.handle_generate_request` aborts the request above it).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any, Optional

SESSION_RULES = """
0.5.23 srt/managers/scheduler_components/weight_updater.py: update_weights_from_distributed (and
_from_tensor) answer success=false unless begin_weight_update opened a session; begin refuses an open
one, end refuses none. flush_cache_after_weight_update + Scheduler.flush_cache: a flush succeeds only
when no request runs (waiting ones count unless paused): paused in_place, running requests keep KV.
"""


# ---------------------------------------------------------------------- loading sglang's definitions
def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this environment (tools/install.sh makes .venv-sglang)")
    return Path(list(spec.submodule_search_locations)[0])


def _package(name: str, path: Path) -> None:
    """Register package `name` at `path` without running its __init__ (sglang's pulls in the runtime)."""
    if name not in sys.modules:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod


def load_module(root: Path, dotted: str) -> types.ModuleType:
    """Import `dotted` (a module under sglang) from its file; parent packages are registered bare."""
    if dotted in sys.modules:
        return sys.modules[dotted]
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        _package(".".join(parts[:i]), root.parent.joinpath(*parts[:i]))
    spec = importlib.util.spec_from_file_location(dotted, root.parent.joinpath(*parts[:-1], parts[-1] + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[dotted] = mod
    spec.loader.exec_module(mod)
    return mod


def route_table(root: Path) -> tuple[dict[tuple[str, str], Optional[str]], dict[str, str]]:
    """{(METHOD, path): request class name or None} from the decorators of http_server.py (and the
    included routers), plus the handlers' docstrings' deprecation notes {path: note}."""
    routes: dict[tuple[str, str], Optional[str]] = {}
    deprecated: dict[str, str] = {}
    files = [root / "srt" / "entrypoints" / "http_server.py", root / "srt" / "entrypoints" / "v1_loads.py"]
    for file in files:
        if not file.exists():
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body_cls = None
            for arg in node.args.args:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                    ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
                    ann = ann.slice  # an optional body (/weights_checker): the class when one is sent
                if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req", "ReqInput_")):
                    body_cls = ann.id
            doc = ast.get_docstring(node) or ""
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                        and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                    continue
                kind, path = dec.func.attr, dec.args[0].value
                if kind in ("get", "post", "put", "delete"):
                    methods = [kind.upper()]
                elif kind == "api_route":
                    methods = [ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"]
                    methods = methods[0] if methods else ["GET"]
                else:
                    continue
                for m in methods:
                    routes[(m, path)] = body_cls
                if "deprecated" in doc.lower():
                    deprecated[path] = doc.splitlines()[0]
    return routes, deprecated


def io_struct_classes(root: Path, names: set[str]) -> dict[str, Any]:
    """The request classes `names` (and what they derive from) executed from io_struct.py's source."""
    file = root / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(file.read_text())
    modname = "sglang.srt.managers.io_struct"
    mod = types.ModuleType(modname)
    mod.__file__ = str(file)
    sys.modules[modname] = mod
    ns = mod.__dict__
    exec("from __future__ import annotations\nimport msgspec, dataclasses\nfrom dataclasses import dataclass, field\n"
         "from typing import *\nfrom enum import Enum\n", ns)
    if (root / "srt" / "utils" / "msgspec_utils.py").exists():  # 0.5.23's request classes are msgspec Structs
        msgspec_utils = load_module(root, "sglang.srt.utils.msgspec_utils")
        ns["msgspec_struct_pydantic_core_schema"] = msgspec_utils.msgspec_struct_pydantic_core_schema
    for extra in ("sglang.srt.utils.weight_versions",):
        try:
            m = load_module(root, extra)
            ns.update({k: v for k, v in vars(m).items() if not k.startswith("_")})
        except Exception:  # noqa: BLE001 - only needed by classes that name it; they fail loudly then
            pass
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    wanted, order = set(), []

    def want(name: str) -> None:
        if name in wanted or name not in classes:
            return
        for base in classes[name].bases:
            if isinstance(base, ast.Name):
                want(base.id)
        wanted.add(name)
        order.append(name)

    for n in names:
        want(n)
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    for node in tree.body:  # type aliases first (those that evaluate with what is loaded)
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                exec(compile(ast.fix_missing_locations(ast.Module(body=[future, node], type_ignores=[])),
                             str(file), "exec"), ns)
            except Exception:  # noqa: BLE001 - an alias over runtime types nobody here needs
                pass
    out = {}
    for name in order:
        exec(compile(ast.fix_missing_locations(ast.Module(body=[future, classes[name]], type_ignores=[])),
                     str(file), "exec"), ns)
        out[name] = ns[name]
    return out


def dataclass_fields(root: Path, cls_name: str) -> set[str]:
    """Field names of a @dataclass in io_struct.py (GenerateReqInput), from its source."""
    tree = ast.parse((root / "srt" / "managers" / "io_struct.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise SystemExit(f"io_struct.py has no class {cls_name}")


# ---------------------------------------------------------------------- checking
class Checker:
    def __init__(self, root: Path, vocab_size: int) -> None:
        self.root, self.vocab_size = root, vocab_size
        self.routes, self.deprecated = route_table(root)
        self.generate_fields = dataclass_fields(root, "GenerateReqInput")
        self.sampling = load_module(root, "sglang.srt.sampling.sampling_params").SamplingParams
        api = root / "api" / "v1" / "api_types.py"
        self.gate = load_module(root, "sglang.api.v1.api_types") if api.exists() else None
        self.classes: dict[str, Any] = {}
        # protocol state of the one server the records went to
        self.session = False
        self.probe: Optional[str] = None  # an end without a session, waiting for the destroy that makes it a clearing
        self.paused: Optional[str] = None
        self.deterministic: Optional[bool] = None
        self.routed_experts: Optional[bool] = None

    def check(self, i: int, rec: dict) -> list[str]:
        method, path, body = rec["method"].upper(), rec["path"], rec.get("body")
        where = f"#{i} {method} {path}"
        if rec.get("replay"):  # the reply of the request before it (server flags), not a request
            return self._protocol(where, path, {}, rec)
        if (method, path) not in self.routes:
            return [f"{where}: SGLang has no such route"]
        errors = []
        if path in self.deprecated:
            errors.append(f"{where}: deprecated in this SGLang ({self.deprecated[path]})")
        if path == "/generate":
            errors += self._generate(where, body)
        else:
            cls_name = self.routes[(method, path)]
            if cls_name is not None and method != "GET":
                errors += self._body(where, cls_name, body)
        errors += self._protocol(where, path, body or {}, rec)
        return errors

    def _generate(self, where: str, body: Any) -> list[str]:
        errors = []
        if self.gate is not None:
            try:
                self.gate.GenerateRequest.from_json_value(body)
            except self.gate.JsonContractError as exc:
                errors.append(f"{where}: contract gate (400): {exc}")
        unknown = sorted(set(body) - self.generate_fields)
        if unknown:
            errors.append(f"{where}: GenerateReqInput has no field(s) {unknown}")
        params = body.get("sampling_params") or {}
        try:
            sp = self.sampling(**params)
            sp.normalize(None)
            sp.verify(self.vocab_size)
        except (TypeError, ValueError) as exc:
            errors.append(f"{where}: SamplingParams: {type(exc).__name__}: {exc}")
        if "sampling_seed" in params and self.deterministic is not True:
            errors.append(f"{where}: sampling_seed sent to a server without --enable-deterministic-inference "
                          f"(SGLang ignores it there)")
        start, ids = body.get("logprob_start_len", -1), body.get("input_ids")
        if start not in (None, -1):
            if not body.get("return_logprob"):
                errors.append(f"{where}: logprob_start_len={start} without return_logprob (the scheduler resets it "
                              f"to -1: no input log-probs come back)")
            if isinstance(ids, list) and isinstance(start, int) and not 0 <= start <= len(ids):
                errors.append(f"{where}: logprob_start_len={start} outside [0, {len(ids)}] (the scheduler aborts the "
                              f"request)")
        if body.get("return_routed_experts"):
            if self.routed_experts is not True:
                errors.append(f"{where}: return_routed_experts sent to a server without --enable-return-routed-experts "
                              f"(SGLang ignores it there: the reply has no routed_experts)")
            start, ids = body.get("routed_experts_start_len", 0), body.get("input_ids")
            if isinstance(ids, list) and not 0 <= start <= len(ids):
                errors.append(f"{where}: routed_experts_start_len={start} outside [0, {len(ids)}] (the scheduler "
                              f"aborts the request)")
        return errors

    def _body(self, where: str, cls_name: str, body: Any) -> list[str]:
        import pydantic

        if cls_name not in self.classes:
            self.classes.update(io_struct_classes(self.root, {cls_name}))
        cls = self.classes.get(cls_name)
        if cls is None:
            return [f"{where}: io_struct.py has no class {cls_name}"]
        try:
            pydantic.TypeAdapter(cls).validate_python({} if body is None else body)
        except pydantic.ValidationError as exc:
            return [f"{where}: {cls_name} rejects the body (FastAPI 422): {exc.errors()[:3]}"]
        except (TypeError, ValueError) as exc:
            return [f"{where}: {cls_name}({body}): {exc}"]
        if isinstance(body, dict):
            fields = {f.name for f in __import__("msgspec").structs.fields(cls)} if hasattr(cls, "__struct_fields__") else None
            if fields is not None and set(body) - fields:
                return [f"{where}: {cls_name} ignores field(s) {sorted(set(body) - fields)} (dropped silently)"]
        return []

    def finish(self) -> list[str]:
        """What is still wrong once the records end (an end-without-session probe nothing followed)."""
        return self._unfollowed_probe()

    def _unfollowed_probe(self) -> list[str]:
        where, self.probe = self.probe, None
        return [f"{where}: no weight-update session is open"] if where else []

    def _protocol(self, where: str, path: str, body: dict, rec: dict) -> list[str]:
        errors = []
        if self.probe and not rec.get("replay"):
            # The pool clears what a dead trainer left before joining (rollout.control.aclear_weight_group):
            # /end_weight_update then /destroy_weights_update_group, each answered success=false by a clean
            # SGLang, which changes nothing. An end without a session followed by anything else is a bug.
            if path == "/destroy_weights_update_group":
                self.probe = None
            else:
                errors += self._unfollowed_probe()
        if path in ("/server_info", "/get_server_info") and isinstance(rec.get("reply"), dict):
            self.deterministic = bool(rec["reply"].get("enable_deterministic_inference"))
            self.routed_experts = bool(rec["reply"].get("enable_return_routed_experts"))
        elif path == "/pause_generation":
            self.paused = body.get("mode", "abort")
        elif path == "/continue_generation":
            self.paused = None
        elif path == "/begin_weight_update":
            if self.session:
                errors.append(f"{where}: a weight-update session is already open")
            self.session = True
        elif path == "/end_weight_update":
            if not self.session:
                self.probe = where  # a violation unless the destroy of the clearing follows
            self.session = False
        elif path == "/update_weights_from_distributed" and not self.session:
            errors.append(f"{where}: outside a begin/end weight-update session: SGLang answers success=false "
                          f"after the trainer started broadcasting")
        if self.paused == "in_place":
            if path == "/flush_cache":
                errors.append(f"{where}: /flush_cache while paused in place (refused: requests hold KV)")
            if path.startswith("/update_weights_from") and body.get("flush_cache", True):
                errors.append(f"{where}: flush_cache (explicit or the default true) while paused in place: the "
                              f"update fails with success=false")
        return errors


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", required=True, help="JSONL of recorded requests (one server, in order)")
    ap.add_argument("--vocab-size", type=int, required=True, help="the served model's vocabulary size")
    args = ap.parse_args(argv)
    root = sglang_root()
    from importlib.metadata import version as dist_version

    version = dist_version("sglang")
    checker = Checker(root, args.vocab_size)
    records = [json.loads(line) for line in Path(args.records).read_text().splitlines() if line.strip()]
    violations = []
    for i, rec in enumerate(records):
        violations += checker.check(i, rec)
    violations += checker.finish()
    kinds = sorted({r["path"] for r in records})
    print(json.dumps({"sglang": version, "checked": len(records), "paths": kinds, "violations": violations}))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
