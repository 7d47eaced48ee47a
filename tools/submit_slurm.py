#!/usr/bin/env python
"""Submits a training run to Slurm: the same as `megatron-rlvr submit`.

python tools/submit_slurm.py CONFIG [key=value ...] --nodes N --gpus-per-node G
    [--partition P] [--time T] [--account A] [--dry-run] [--follow]
"""

import sys

from megatron_rlvr.cli import main

if __name__ == "__main__":
    sys.exit(main(["submit", *sys.argv[1:]]))
