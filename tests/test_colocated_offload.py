"""The colocated learner's offload (learner/offload.py): what it sets aside comes back exactly,
so training with an offload and onload around every step ends where training straight through
does; it counts the optimizer's and the gradients' bytes; on CUDA it frees them."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_ranks

WORKER = Path(__file__).with_name("colocated_worker.py")


@pytest.mark.parametrize(
    "layout",
    [[], pytest.param(["parallel.device=cuda", "trainer.dtype=bfloat16"], marks=pytest.mark.gpu)],
    ids=["cpu", "cuda-bf16"],
)
def test_an_offload_round_trip_every_step_changes_no_update(layout, tiny_hf_dir, tmp_path):
    r = run_ranks(1, ["offload", str(tiny_hf_dir), *layout], tmp_path, worker=WORKER)[0]
    assert r["weight_gap"] <= r["noise_gap"], r  # CPU: both 0.0, bit for bit
    if not layout:
        assert r["grad_norms"][0] == r["grad_norms"][1], r
    first, later = r["moved"][0], r["moved"][-1]
    assert first["colocate/offload_grad_bytes"] > 0
    # fp32 per parameter: the optimizer's master copy from the start, Adam's m and v after a step;
    # the gradient buffer is fp32 per parameter too (grad_reduce_in_fp32), padded to its buckets
    assert later["colocate/offload_optimizer_bytes"] == 3 * first["colocate/offload_optimizer_bytes"] > 0
    assert first["colocate/offload_grad_bytes"] >= first["colocate/offload_optimizer_bytes"]
    if layout:  # on the GPU the bytes set aside are bytes freed
        moved = later["colocate/offload_optimizer_bytes"] + later["colocate/offload_grad_bytes"]
        assert r["freed"][-1] >= moved, r
    else:
        assert r["freed"] == [0, 0, 0]
