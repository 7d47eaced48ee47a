"""Packed sequences (trainer.pack_sequences): the pack/unpack index arithmetic against hand
computations and round trips, the routing reorder, the packed budget cut and the config refusal
on CPU; the packed learner against the budgeted one on a GPU (THD runs on transformer-engine's
bf16 attention only: the `gpu` test skips without CUDA, scripts/gpu_check.py's `packed` step
runs it). That GPU test has not been run yet: no machine it was written on had a GPU."""

import pytest
import torch
from distributed import run_ranks

from megatron_rlvr.config import ConfigError, load_config
from megatron_rlvr.learner.batch import TrainBatch, budget_bins, budget_micro_batches
from megatron_rlvr.learner.packing import (
    cu_seqlens,
    pack,
    packed_positions,
    packed_rows,
    packed_seq_params,
    row_starts,
    unpack,
    unpack_rows,
)
from megatron_rlvr.learner.routing_replay import local_token_order

EXTENTS = torch.tensor([3, 5, 1])  # padded to multiples of 2: 4, 6, 2 → 12 packed positions


def test_layout_by_hand():
    rows = packed_rows(EXTENTS, multiple=2)
    assert rows.padded.tolist() == [4, 6, 2] and rows.total == 12 and rows.starts.tolist() == [0, 4, 10]
    assert packed_positions(rows).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert row_starts(rows)[0].nonzero().flatten().tolist() == [0, 4, 10]
    assert cu_seqlens(rows.lengths).tolist() == [0, 3, 8, 9] and cu_seqlens(rows.lengths).dtype == torch.int32
    params = packed_seq_params(rows, torch.device("cpu"))  # each row's padding is its own: none between rows
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [
        0,
        4,
        10,
        12,
    ]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q_padded is None
    assert params.max_seqlen_q == params.max_seqlen_kv == 6
    assert packed_rows(torch.tensor([0]), multiple=4).padded.tolist() == [4]  # a filler row is never empty


def test_pack_concatenates_rows_and_unpack_gives_the_padded_layout_back():
    ids = torch.arange(3 * 7).view(3, 7)  # width 7 >= every padded row
    rows = packed_rows(EXTENTS, multiple=2)
    assert pack(ids, rows).tolist() == [[0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 14, 15]]
    values = torch.randn(3, 7, requires_grad=True)
    back = unpack(pack(values, rows), rows, width=7)
    column = torch.arange(7).expand(3, 7)
    kept = (column >= 1) & (column < rows.padded[:, None])  # position 0 never counts; past the pack: 0
    assert torch.equal(back[kept], values[kept]) and not back[~kept].any()
    back.sum().backward()  # gradients reach exactly the kept positions
    assert torch.equal(values.grad, kept.float())


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Reference per-token logprobs [b, s] (position t: ids[t] from logits[t - 1]; column 0: 0)."""
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def test_logprobs_of_the_pack_unpack_to_each_rows_own():
    """The pack's logprob at a row's first position comes from the previous row's last one: it
    is masked, and every position that counts equals the row's logprob computed alone."""
    gen = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 6, 11, generator=gen), torch.randint(0, 11, (3, 6), generator=gen)
    rows = packed_rows(EXTENTS, multiple=2)
    packed = _next_token_logprobs(pack(logits, rows), pack(ids, rows))
    assert packed[0, 4] != 0  # row 1's first token, "predicted" by row 0's last position
    column = torch.arange(6).expand(3, 6)
    counted = (column >= 1) & (column < rows.lengths[:, None])
    assert torch.allclose(unpack(packed, rows, 6)[counted], _next_token_logprobs(logits, ids)[counted])


def test_packed_routing_order_is_the_rows_concatenated_and_splits_back():
    gen = torch.Generator().manual_seed(1)
    routing = torch.randint(0, 8, (3, 6, 2, 2), generator=gen)  # [B, T, layers, top_k]
    rows = packed_rows(EXTENTS, multiple=2)
    packed = pack(routing, rows)
    expected = torch.cat([routing[i, :n] for i, n in enumerate(rows.padded.tolist())])
    assert torch.equal(local_token_order(packed, 0, 1, sequence_parallel=False), expected)
    for rank in range(2):  # sequence parallel: each TP rank routes its half of the pack
        assert torch.equal(
            local_token_order(packed, rank, 2, sequence_parallel=True), expected[rank * 6 : rank * 6 + 6]
        )
    kept = unpack_rows(expected, rows)  # what R2 records per row from the pack's routing
    assert [k.shape[0] for k in kept] == [4, 6, 2]
    assert all(torch.equal(k, routing[i, : len(k)]) for i, k in enumerate(kept))


def test_packed_budget_counts_the_sum_of_rows():
    extents = [5, 16, 3, 3, 9, 4, 2]
    bins = budget_bins(extents, max_tokens=16, packed=True)
    assert bins == [[1], [4, 0, 6], [5, 2, 3]]  # 16 | 9+5+2 | 4+3+3: first fit decreasing, by sums
    assert all(sum(extents[i] for i in b) <= 16 for b in bins)
    assert len(budget_bins(extents, max_tokens=16)) > len(bins)  # rows × longest wastes the padding


def test_packed_micro_batches_carry_their_layout():
    mask = torch.zeros(4, 12)
    for row, n in enumerate([3, 9, 1, 2]):
        mask[row, 2 : 2 + n] = 1
    batch = TrainBatch(torch.arange(48).view(4, 12), mask)
    micro, _ = budget_micro_batches(batch, [torch.arange(4)], 0, max_tokens=16, multiple=2, packed=True)
    assert [mb.rows.tolist() for mb in micro] == [[1, 3], [0, 2]]  # extents 5, 11, 3, 4 → widths 6, 12, 4, 4
    first = micro[0]
    assert (
        first.packed is not None
        and first.packed.lengths.tolist() == [11, 4]
        and first.packed.padded.tolist() == [12, 4]
    )
    assert first.data.input_ids.shape == (2, 12)
    filler, _ = budget_micro_batches(batch, [torch.arange(1), torch.arange(1, 4)], 0, max_tokens=12, packed=True)
    assert filler[-1].rows.numel() == 0 and filler[-1].packed is not None and filler[-1].packed.total == 1


RUNNABLE = ["trainer.pack_sequences=true", "parallel.device=cuda", "trainer.dtype=bfloat16"]


@pytest.mark.parametrize(
    "overrides",
    [
        [*RUNNABLE, "trainer.max_tokens_per_microbatch=64", "parallel.device=cpu"],  # local attention: no THD
        [*RUNNABLE, "trainer.max_tokens_per_microbatch=64", "trainer.dtype=float32"],  # TE: no fp32 THD backend
        RUNNABLE,  # without a token budget
    ],
)
def test_packing_is_refused_where_it_cannot_run(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert [line for line in err.value.problems if line.startswith("trainer.pack_sequences = true: ")], err.value
    assert load_config(None, [*RUNNABLE, "trainer.max_tokens_per_microbatch=64"]).trainer.pack_sequences


BF16 = 3e-2  # bf16 keeps 8 bits of mantissa; THD and BSHD run different attention kernels


@pytest.mark.gpu
def test_packed_step_equals_the_budgeted_step(tiny_hf_dir, tmp_path):
    """World 1 on CUDA (transformer-engine spec): packed (THD) against budgeted micro-batches,
    without replay, with R2 and with R3. In bf16: transformer-engine has no fp32 attention for THD
    (its unfused backend refuses it), so the two agree to bf16's precision, not to 1e-5."""
    (result,) = run_ranks(1, ["packed", str(tiny_hf_dir), "parallel.device=cuda", "trainer.dtype=bfloat16"], tmp_path)
    for mode, d in result.items():
        if mode != "none":  # natural routing may flip a near-tied expert under bf16 rounding
            assert d["logprob_diff"] <= BF16, (mode, d["logprob_diff"])  # relative, where |logprob| > 1
        assert d["grad_diff"] <= BF16 * d["grad_scale"] and d["grad_scale"] > 1e-3, (mode, d["grad_diff"])
        budget, packed = d["budget"], d["packed"]
        for key in ("policy_loss", "entropy", "grad_norm", "ratio_mean", "rollout_is_mean"):
            assert packed[key] == pytest.approx(budget[key], rel=BF16, abs=BF16), (mode, key)
        if mode != "none":
            assert min(d["checked"]) > 0 and d["mismatched"] == [0, 0], mode
            agreement = "routing_agreement_used" if mode == "r2" else "routing_agreement_engine_used"
            assert packed[agreement] == 1.0, mode
