#!/usr/bin/env python
"""HF <-> Megatron checkpoints, for people who expect a script: the same as
`megatron-rlvr convert`.

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N --etp N] [--dtype bf16|fp32]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--hf-config DIR] [--dtype bf16|fp32]
"""

from __future__ import annotations

import sys

from megatron_rlvr.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
