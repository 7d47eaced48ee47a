#!/usr/bin/env python
"""Runs routing-replay modes side by side and reports which kept training stable: the same as
`megatron-rlvr compare-replay`.

    python tools/compare_routing_replay.py CONFIG [key=value ...] --modes none,r2,r3
        [--algos grpo,gspo] [--off-policy 1,2,4] [--vary algo.KEY=V1,V2 ...] [--steps N] [--seeds K]
        [--out DIR] [--submit]
"""

import sys

from megatron_rlvr.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare-replay", *sys.argv[1:]]))
