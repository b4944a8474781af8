#!/usr/bin/env python
"""Evaluate an HF checkpoint: avg@n, pass@k and maj@n per dataset (see megatron_bapo/eval/cli.py)."""

from megatron_bapo.eval.cli import main

if __name__ == "__main__":
    from megatron_bapo.process_exit import exit_now

    exit_now(main())  # no module teardown once main has returned (megatron_bapo/process_exit.py)
