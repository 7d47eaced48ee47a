"""The memory plan's model-state bytes equal what the real learner allocates: parameters (or
the distributed optimizer's parameter buffers), the fp32 gradient buffers, and the optimizer's
fp32 master copies and Adam moments after one step, per rank, on the tiny Qwen3-MoE in gloo
worlds of 1 and 2 processes, with the distributed optimizer on and off.

This file is also the rank worker (run by tests/distributed.py):

    test_plan_learner.py HF_DIR SETTING[,SETTING...] [dotted.config=overrides ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from distributed import run_ranks

from megatron_rlvr.plan.model_state import Layout, state_bytes
from megatron_rlvr.plan.shape import read_config_json, shape_from_hf

BASE = ["trainer.micro_batch_size=2", "rollout.max_new_tokens=8", "algo.num_minibatches=1"]
SETTINGS = {
    "bf16-dist": ["trainer.dtype=bfloat16", "trainer.distributed_optimizer=true"],
    "bf16-plain": ["trainer.dtype=bfloat16", "trainer.distributed_optimizer=false"],
    "fp32-dist": ["trainer.dtype=float32", "trainer.distributed_optimizer=true"],
    "fp32-plain": ["trainer.dtype=float32", "trainer.distributed_optimizer=false"],
}
# ep2 shards the dense parameters' optimizer over DP 2 (with the buffer's padding); TP 2 and
# PP 2 (the stages' embedding and output layer) are in the slow tier
LAYOUTS = {
    "ep2": ["parallel.ep=2"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
}


def _measure(learner) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes, from the tensors themselves."""
    buffers = [b for chunk in learner.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    if all(b.param_data is not None for b in buffers):
        params = sum(b.param_data.nbytes for b in buffers)
    else:
        params = sum(p.nbytes for m in learner.modules for p in m.parameters())
    grads = sum(b.grad_data.nbytes for b in buffers)
    optimizer = 0
    for inner in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        for state in inner.optimizer.state.values():
            optimizer += state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            optimizer += sum(t.nbytes for group in getattr(inner, name, []) for t in group if t is not None)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def worker() -> None:
    import torch

    from megatron_rlvr.config import load_config
    from megatron_rlvr.learner.batch import TrainBatch
    from megatron_rlvr.learner.learner import Learner
    from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel

    hf_dir, names, *overrides = sys.argv[1:]
    result: dict = {}
    if names == "cuda-peak":
        result = _cuda_peak(hf_dir, overrides)
        names = ""
    for name in filter(None, names.split(",")):
        cfg = load_config(None, [*BASE, *overrides, *SETTINGS[name]])
        if not result:
            init_parallel(cfg.parallel, seed=0)
        learner = Learner(cfg, hf_dir)
        gen = torch.Generator().manual_seed(0)
        vocab = learner.bridge.hf_config.vocab_size
        batch = TrainBatch(torch.randint(0, vocab, (4, 8), generator=gen), torch.ones(4, 8))
        batch.old_logprobs = batch.rollout_logprobs = learner.compute_logprobs(batch)
        batch.advantages = torch.randn(4, generator=gen)
        learner.train_step(batch)  # Adam's moments exist from the first step on
        from megatron.core import parallel_state as mpu

        result[name] = {
            **_measure(learner),
            "stage": mpu.get_pipeline_model_parallel_rank(),
            "layout": [cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.etp],
        }
        learner.close()
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


CUDA_PROMPT_TOKENS = 24  # the batch of the GPU comparison: prompts of this length, full responses


def _cuda_peak(hf_dir: str, overrides: list[str]) -> dict:
    """One train step of the tiny model on CUDA over the batch the plan assumes (batch_groups ×
    n rows of prompt + max_new_tokens): the allocator's peak against the plan's learner peak."""
    import torch

    from megatron_rlvr.config import load_config
    from megatron_rlvr.learner.batch import TrainBatch
    from megatron_rlvr.learner.learner import Learner
    from megatron_rlvr.learner.parallel import init_parallel
    from megatron_rlvr.plan.build import learner_plan

    cfg = load_config(None, [*BASE, "parallel.device=cuda", "trainer.dtype=bfloat16", *overrides])
    init_parallel(cfg.parallel, seed=0)
    learner = Learner(cfg, hf_dir)
    rows = cfg.buffer.batch_groups * cfg.rollout.n_samples_per_prompt
    length = CUDA_PROMPT_TOKENS + cfg.rollout.max_new_tokens
    gen = torch.Generator().manual_seed(0)
    batch = TrainBatch(
        torch.randint(0, learner.bridge.hf_config.vocab_size, (rows, length), generator=gen), torch.ones(rows, length)
    )
    torch.cuda.reset_peak_memory_stats()
    batch.old_logprobs = batch.rollout_logprobs = learner.compute_logprobs(batch)
    batch.advantages = torch.randn(rows, generator=gen)
    learner.train_step(batch)
    measured = torch.cuda.max_memory_allocated()
    plan = learner_plan(cfg, shape_from_hf(read_config_json(Path(hf_dir))), 80 * 10**9, CUDA_PROMPT_TOKENS)
    held = plan.phase_bytes()[""]
    learner.close()
    return {"measured": measured, "planned": plan.device_bytes, "held": held}


@pytest.mark.gpu
def test_the_plan_against_a_real_cuda_step(tiny_hf_dir, tmp_path, record_property):
    """scripts/gpu_check.sh: the plan's learner peak against torch's allocator peak in a real
    train step on the GPU; the ratio goes to the report. The model state is the plan's exact
    part (equal to the learner's tensors on CPU): the peak can never be below it."""
    (result,) = run_ranks(1, [str(tiny_hf_dir), "cuda-peak"], tmp_path, worker=Path(__file__))
    ratio = result["planned"] / result["measured"]
    record_property("plan_over_measured", round(ratio, 3))
    record_property("measured_bytes", result["measured"])
    record_property("planned_bytes", result["planned"])
    print(f"plan {result['planned']} B / measured peak {result['measured']} B = {ratio:.3f}")
    assert result["held"] <= result["measured"], result


def _check(results: list[dict], hf_dir: Path) -> None:
    shape = shape_from_hf(read_config_json(hf_dir))
    assert results and all(results[0].keys() == r.keys() for r in results)
    for name in results[0]:
        dtype = "bfloat16" if "bf16" in name else "float32"
        by_stage: dict[int, list[dict]] = {}
        for rank in results:
            by_stage.setdefault(rank[name]["stage"], []).append(rank[name])
        for stage, ranks in by_stage.items():
            layout = Layout(*ranks[0]["layout"])
            plan = state_bytes(
                shape, layout, stage, dtype=dtype, distributed="dist" in name, norms_fp32=True
            )  # the CPU learner's torch norms are fp32
            where = (name, stage)
            assert {r["params"] for r in ranks} == {plan.params}, where
            assert {r["grads"] for r in ranks} == {plan.grads}, where
            assert max(r["optimizer"] for r in ranks) == plan.optimizer, where


def test_world1_state_bytes_equal_the_learners(tiny_hf_dir, tmp_path):
    results = run_ranks(1, [str(tiny_hf_dir), ",".join(SETTINGS)], tmp_path, worker=Path(__file__))
    _check(results, tiny_hf_dir)


@pytest.mark.parametrize("layout", [k if k == "ep2" else pytest.param(k, marks=pytest.mark.slow) for k in LAYOUTS])
def test_two_process_state_bytes_equal_the_learners(layout, tiny_hf_dir, tmp_path):
    settings = "bf16-dist,bf16-plain,fp32-dist"
    results = run_ranks(2, [str(tiny_hf_dir), settings, *LAYOUTS[layout]], tmp_path, worker=Path(__file__))
    _check(results, tiny_hf_dir)


if __name__ == "__main__":
    worker()
