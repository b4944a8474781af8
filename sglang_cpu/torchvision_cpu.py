"""Make PyPI's torchvision importable beside the CPU torch, in the SGLang server venv.

    .venv-sglang/bin/python sglang_cpu/torchvision_cpu.py    # tools/install.sh --with-sglang runs it

SGLang imports `torchvision.transforms` at startup (its DeepSeek-OCR config, loaded by the HF config
utilities every model goes through), but only vision models use it. PyPI's x86_64 torchvision wheels
are CUDA builds: their compiled ops (`_C.so`, `image.so`) link `libtorch_cuda.so`, which a CPU torch
does not have, and no CPU wheel or source distribution is on PyPI. torchvision is built to run
without its compiled ops (a failed load leaves `extension._has_ops()` False, and every op then
raises torchvision's own "Couldn't load custom C++ ops"), except for two fake-tensor registrations in
`_meta_registrations.py` (`torchvision::nms`, `torchvision::qnms`) that, unlike the others in that
file, are not guarded by `_has_ops()` and fail at import ("operator torchvision::nms does not
exist"). So, in the installed package only:
- each compiled library that cannot load against this torch is removed (a CPU build that loads is
  kept, and then nothing below changes), with the CUDA runtime bundled for them (`torchvision.libs`);
- the two registrations get the guard the others have.
Idempotent; exits non-zero naming what it found if the package does not look as expected. The torch
2.14.1 + torchvision 0.29.1 pair on this machine's disk is not an option: it is a CUDA torch.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

GUARD = "_register_fake_if_ops"
GUARD_DEF = f'''

def {GUARD}(op_name):
    # Added by megatron_bapo's sglang_cpu/torchvision_cpu.py: this torchvision has no compiled ops
    # (a CUDA build beside a CPU torch), so register fakes only when the ops exist, like register_meta.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn
'''
UNGUARDED = '@torch.library.register_fake("torchvision::'
ANCHOR = "import torchvision.extension  # noqa: F401\n"


def package_dir() -> Path:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchvision is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0])


def loads(lib: Path) -> tuple[bool, str]:
    """Whether `lib` loads against this interpreter's torch (in a child: a failed dlopen can leave
    state behind), and the error if not."""
    code = "import sys, torch; torch.ops.load_library(sys.argv[1])"
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    return out.returncode == 0, (out.stderr.strip().splitlines() or [""])[-1]


def remove_unloadable(pkg: Path) -> list[str]:
    removed = []
    for lib in sorted(pkg.glob("*.so")):
        ok, err = loads(lib)
        if not ok:
            lib.unlink()
            removed.append(f"{lib.name} ({err})")
    bundled = pkg.parent / "torchvision.libs"
    if removed and not list(pkg.glob("*.so")) and bundled.is_dir():
        shutil.rmtree(bundled)
        removed.append(f"{bundled.name}/ (the CUDA runtime bundled for them)")
    return removed


def guard_fake_registrations(pkg: Path) -> int:
    path = pkg / "_meta_registrations.py"
    text = path.read_text()
    if GUARD in text:
        return 0
    count = text.count(UNGUARDED)
    if ANCHOR not in text:
        raise SystemExit(f"{path}: the line {ANCHOR.strip()!r} is gone; this torchvision is not the one "
                         f"sglang_cpu/torchvision_cpu.py was written for")
    text = text.replace(ANCHOR, ANCHOR + GUARD_DEF, 1).replace(UNGUARDED, f'@{GUARD}("torchvision::')
    path.write_text(text)
    return count


def main() -> int:
    pkg = package_dir()
    removed = remove_unloadable(pkg)
    has_ops = any(pkg.glob("_C.so"))
    guarded = 0 if has_ops else guard_fake_registrations(pkg)
    check = subprocess.run([sys.executable, "-c", "import torchvision.transforms, torchvision.extension as e; "
                            "print(torchvision.__version__, e._has_ops())"], capture_output=True, text=True)
    if check.returncode != 0:
        print(check.stderr[-3000:], file=sys.stderr)
        print(f"torchvision at {pkg} still fails to import (removed: {removed or 'nothing'}; guarded {guarded} "
              f"registrations)", file=sys.stderr)
        return 1
    version, ops = check.stdout.split()
    print(f"torchvision {version}: imports, compiled ops {'loaded' if ops == 'True' else 'absent'}"
          f"{'; removed ' + ', '.join(removed) if removed else ''}"
          f"{f'; guarded {guarded} fake registrations' if guarded else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
