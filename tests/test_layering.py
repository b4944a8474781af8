"""Package layering: the trainer side talks to the servers over HTTP only.

The rollout client, the weight sync, evaluation, the driver and the trainer must not import the
built-in server application (it is a separate process in every deployment; a real SGLang server
replaces it on clusters). What both sides share (the weight-update wire protocol) lives in a
neutral module, `megatron_bapo.weight_update`.
"""

from __future__ import annotations

import subprocess
import sys


def test_trainer_side_never_imports_the_server_application():
    code = ("import sys, megatron_bapo.trainer, megatron_bapo.driver, megatron_bapo.sync, megatron_bapo.rollout, "
            "megatron_bapo.rollout.producer, megatron_bapo.eval, megatron_bapo.weight_update; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('megatron_bapo.server'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"trainer-side imports pulled in: {out.stdout.strip()}"
