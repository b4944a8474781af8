"""Check that an environment holds exactly the package versions of requirements.lock.

    python tools/check_lock.py [--lock requirements.lock]   # exit 1 naming every locked package that differs

tools/install.sh runs it after installing (an install that drifted from the lock is refused), and
tests/test_install_lock.py runs it against the test environment. Versions compare without local
labels (`torch 2.13.0+cpu` is the lock's `torch==2.13.0`).
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> tuple[dict[str, str], str]:
    """({canonical name: version}, the Python "major.minor" it was resolved for)."""
    pins, python = {}, ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("# python:"):
            python = line.split(":", 1)[1].strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        pins[canonical(name)] = version.strip()
    return pins, python


def differences(pins: dict[str, str]) -> list[str]:
    """What the running environment has that the lock does not say, one line each."""
    installed = {canonical(d.metadata["Name"]): d.version.split("+")[0] for d in metadata.distributions()}
    out = []
    for name, version in sorted(pins.items()):
        have = installed.get(name)
        if have != version:
            out.append(f"{name}: locked {version}, installed {have or 'nothing'}")
    return out


def extras(pins: dict[str, str]) -> list[str]:
    """Installed packages the lock does not name (installed by hand: reported, not refused)."""
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    return sorted(set(installed) - set(pins) - {"pip", "setuptools", "wheel", "megatron-bapo"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lock", type=Path, default=ROOT / "requirements.lock")
    args = parser.parse_args()
    pins, python = read_lock(args.lock)
    diff = differences(pins)
    if diff:
        print(f"the environment differs from {args.lock} (resolved for Python {python}) in {len(diff)} package(s): "
              + "; ".join(diff) + ". Run `bash tools/install.sh` (a new dependency: refresh the lock with "
              "`bash tools/lock_deps.sh`)", file=sys.stderr)
        return 1
    more = extras(pins)
    print(f"{len(pins)} packages as locked in {args.lock.name}" + (f"; also installed, not locked: {', '.join(more)}"
                                                                   if more else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
