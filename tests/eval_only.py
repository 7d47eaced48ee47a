"""Opens a run (engines, learner, verifiers) and evaluates the initial policy, with no
training after it; prints the eval metrics as JSON. Used by test_evaluation.py."""

import json
import sys

from megatron_rlvr.config import load_config
from megatron_rlvr.run import open_run
from megatron_rlvr.stopping import never

if __name__ == "__main__":
    cfg = load_config(sys.argv[1], sys.argv[2:])
    with open_run(cfg, never()) as run:
        metrics = run.evaluate(0)
    print(json.dumps(metrics))
