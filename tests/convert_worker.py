"""One learner rank started from a converted Megatron checkpoint (model.mcore_checkpoint),
launched by tests/distributed.py with its WORKER pointed here.

    convert_worker.py CONFIG_DIR CKPT REFERENCE_DIR LEARNER_CKPT [dotted.config=overrides ...]

CONFIG_DIR gives the config (it holds no weights, so they can only come from CKPT);
REFERENCE_DIR is the HF checkpoint CKPT was converted from. The rank checks logprobs and
export against it, trains one step, saves a learner checkpoint to LEARNER_CKPT and the
trained weights, as HF tensors, to LEARNER_CKPT/../trained.safetensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from learner_worker import BASE, fixed_batch, hf_logprobs, with_rl_fields

from megatron_rlvr.config import load_config
from megatron_rlvr.learner.checkpoint import save_checkpoint
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel


def main() -> None:
    from safetensors.torch import load_file, save_file

    config_dir, ckpt, reference, learner_ckpt, *rest = sys.argv[1:]
    cfg = load_config(
        None, [*BASE, "model.type=hf", f"model.path={config_dir}", f"model.mcore_checkpoint={ckpt}", *rest]
    )
    init_parallel(cfg.parallel, seed=cfg.trainer.seed)
    learner = Learner(cfg, config_dir)
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    logprobs = learner.compute_logprobs(batch)
    original = load_file(os.path.join(reference, "model.safetensors"))
    exported = {name: tensor.clone() for name, tensor in learner.export_hf()}
    result = {
        "logprob_max_diff_vs_reference": float((logprobs - hf_logprobs(reference, batch.input_ids))[:, 1:].abs().max()),
        "export_equals_reference": sorted(exported) == sorted(original)
        and all(torch.equal(exported[n], original[n]) for n in original),
    }
    learner.train_step(with_rl_fields(batch, logprobs))
    save_checkpoint(learner, learner_ckpt)
    trained = {name: tensor.clone().contiguous() for name, tensor in learner.export_hf()}
    if int(os.environ["RANK"]) == 0:
        save_file(trained, str(Path(learner_ckpt).parent / "trained.safetensors"))
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
