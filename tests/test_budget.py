"""Token-budget micro-batches: the cut (first-fit decreasing, rows over the budget alone, equal
forward counts over data-parallel ranks), and the learner with budgets against the padded
path in real gloo worlds: world 1, TP2+SP, EP2, PP2 (with activation recompute), without
replay, with R2 and with R3: one process launch per layout."""

import pytest
import torch
from distributed import run_ranks

from megatron_rlvr.learner.batch import TrainBatch, budget_bins, budget_micro_batches, even_out, row_extents


def _batch(responses: list[int], width: int = 16, prompt: int = 2) -> TrainBatch:
    mask = torch.zeros(len(responses), width)
    for row, n in enumerate(responses):
        mask[row, prompt : prompt + n] = 1
    ids = torch.arange(len(responses) * width).view(len(responses), width)
    return TrainBatch(ids, mask, routed_experts=ids[:, :, None, None].expand(-1, -1, 2, 2).clone())


def test_extents_end_at_the_last_response_token():
    assert row_extents(_batch([3, 0, 14])).tolist() == [5, 0, 16]


def test_first_fit_decreasing_keeps_every_micro_batch_within_its_budget():
    extents = [5, 16, 3, 3, 9, 0, 4, 2, 30]
    bins = budget_bins(extents, max_tokens=16)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4, 6, 7, 8]  # the empty row goes nowhere
    for b in bins:
        cost = len(b) * max(extents[i] for i in b)
        assert cost <= 16 or len(b) == 1, (b, cost)  # only a row over the budget exceeds it, alone
    assert [8] in bins and [1] in bins
    assert len(bins) == 5  # 30 | 16 | 9 | 5,4,3 → 15 | 3,2 → 6: first fit decreasing
    assert budget_bins([5, 3], max_tokens=8, multiple=4) == [[0], [1]]  # widths round up to 8 and 4


def test_even_out_splits_the_fullest_then_adds_fillers():
    assert even_out([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert even_out([[0], [1]], 3) == [[0], [1], []]


def test_budget_micro_batches_trim_to_their_longest_row_and_match_forward_counts():
    batch = _batch([14, 1, 1, 1, 2, 2, 1, 1])  # rank 0: rows 0-3, rank 1: rows 4-7
    ranks = [torch.arange(4), torch.arange(4, 8)]
    micro0, over0 = budget_micro_batches(batch, ranks, 0, max_tokens=12, multiple=2)
    micro1, over1 = budget_micro_batches(batch, ranks, 1, max_tokens=12, multiple=2)
    assert over0 == [16] and over1 == []
    assert [mb.rows.tolist() for mb in micro0] == [[0], [1, 2, 3]]
    assert [mb.data.input_ids.shape[1] for mb in micro0] == [16, 4]  # extents 16 and 3, even for SP
    assert len(micro1) == 2 and sorted(i for mb in micro1 for i in mb.rows.tolist()) == [4, 5, 6, 7]
    mb = micro0[1]
    assert torch.equal(mb.data.input_ids, batch.input_ids[1:4, :4])
    assert torch.equal(mb.data.routed_experts, batch.routed_experts[1:4, :4])  # R3's routing cut alike
    filler, _ = budget_micro_batches(batch, [torch.arange(1), torch.arange(1, 8)], 0, max_tokens=16)
    assert len(filler) == 2 and filler[1].rows.numel() == 0 and filler[1].data.response_mask.sum() == 0


LAYOUTS = {
    "world1": (1, []),
    "tp2-sp": (2, ["parallel.tp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "pp2-recompute": (2, ["parallel.pp=2", "trainer.recompute_activations=true"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_budgeted_step_equals_the_padded_step(layout, tiny_hf_dir, tmp_path):
    world, overrides = LAYOUTS[layout]
    for rank, r in enumerate(run_ranks(world, ["budget", str(tiny_hf_dir), *overrides], tmp_path)):
        for mode, d in r.items():
            where = (layout, rank, mode)
            assert d["logprob_diff"] <= 1e-6, (where, d["logprob_diff"])  # relative, where |logprob| > 1
            # fp32 gradients summed in another order: up to 1.3e-6 with R2's perturbed routers and a
            # quarter of the tokens rejected (5e-7 without rejection), in every layout alike
            assert d["grad_diff"] <= 2e-6 and d["grad_scale"] > 1e-2, (where, d["grad_diff"], d["grad_scale"])
            padded, budget = d["padded"], d["budget"]
            for key in ("policy_loss", "entropy", "clipfrac", "ratio_mean", "rollout_is_mean"):
                assert budget[key] == pytest.approx(padded[key], rel=1e-6, abs=1e-6), (where, key)
            # the norm of those gradients, to their bound (TP2+SP with R2 on an AMD EPYC: 1.2e-6)
            assert budget["grad_norm"] == pytest.approx(padded["grad_norm"], rel=2e-6), (where, "grad_norm")
            assert 0.05 < budget["rollout_rs_masked_fraction"] < 0.5, where  # rejection is on and bites
            if mode != "none":
                assert min(d["checked"]) > 0 and d["mismatched"] == [0, 0], where
                agreement = "routing_agreement_used" if mode == "r2" else "routing_agreement_engine_used"
                assert budget[agreement] == 1.0, where
            if mode == "r2":  # perturbed routers: replay held the recorded routing
                assert budget["routing_agreement"] == pytest.approx(padded["routing_agreement"], abs=1e-9)
    log = (tmp_path / "rank0.log").read_text()
    assert log.count("longer than the token budget") == 3  # once per budgeted learner (3 modes)
