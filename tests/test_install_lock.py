"""A fresh install reproduces the README: `tools/install.sh` installs exactly `requirements.lock`
(the resolved package set, refreshed by `bash tools/lock_deps.sh`) and refuses an environment that
drifted from it. This checks the environment the tests run in, as the install left it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def _check(lock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "check_lock.py"), "--lock", str(lock)],
                          capture_output=True, text=True, timeout=60)


def test_the_installed_packages_are_the_locked_ones():
    done = _check(LOCK)
    assert done.returncode == 0, done.stderr
    pins = [ln for ln in LOCK.read_text().splitlines() if ln and not ln.startswith("#")]
    assert "torch==2.13.0" in pins, "CPU torch must stay the local 2.13.0 build"
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", ln) for ln in pins), "every line pins one exact version"


def test_every_dependency_the_project_declares_is_locked():
    from importlib import metadata

    from packaging.requirements import Requirement

    locked = {re.sub(r"[-_.]+", "-", ln.split("==")[0]).lower()
              for ln in LOCK.read_text().splitlines() if ln and not ln.startswith("#")}
    needed = []
    for spec in metadata.requires("megatron_bapo") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": "dev"}):  # the install's `.[dev]`
            needed.append(re.sub(r"[-_.]+", "-", req.name).lower())
    assert needed and not sorted(set(needed) - locked), sorted(set(needed) - locked)


def test_a_drifted_package_is_named(tmp_path):
    lines = LOCK.read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("numpy=="))
    lines[i] = "numpy==1.0.0"
    drifted = tmp_path / "requirements.lock"
    drifted.write_text("\n".join(lines) + "\n")
    done = _check(drifted)
    assert done.returncode == 1
    assert re.search(r"numpy: locked 1\.0\.0, installed \d", done.stderr), done.stderr
