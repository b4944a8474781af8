#!/usr/bin/env python
"""Evaluate an HF checkpoint: avg@n, pass@k and maj@n per dataset (see megatron_bapo/eval/cli.py)."""

import sys

from megatron_bapo.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
