"""Episodes on the learner side: tokens the model did not sample (tool turns, template
boundaries: Sample.loss_mask 0) stay in the sequence but count nowhere. The batch's mask is the
loss mask; the loss, its gradient and every metric of a batch with tool gaps equal those of the
same samples with the gaps cut out (for every loss kind, aggregation and rollout correction that
has a per-sequence part); GSPO's sequence ratio, response lengths, staleness and token-budget
packing see only sampled tokens."""

import pytest
import torch

from megatron_rlvr.algo.baselines import AdvantageOptions
from megatron_rlvr.algo.corrections import RolloutCorrection
from megatron_rlvr.algo.losses import _sequence_ratio, policy_loss
from megatron_rlvr.batching import groups_to_batch, response_length_metrics
from megatron_rlvr.config.rejection import parse_rejection
from megatron_rlvr.learner.batch import budget_micro_batches
from megatron_rlvr.learner.forward import step_normalizer
from megatron_rlvr.learner.packing import pack, unpack
from megatron_rlvr.loop_metrics import staleness_metrics
from megatron_rlvr.samples import Group, Sample

# response layouts: 1 = a token the model sampled, 0 = a tool turn's or boundary's token
LAYOUTS = [
    [1, 1, 1, 0, 0, 0, 0, 1, 1],  # turn, tool turn, turn
    [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1],  # two tool turns
    [1, 1, 1, 1],  # answered at once
    [1, 0, 0, 0, 1, 1, 0, 0],  # ended on a tool turn (max_turns)
]
REWARDS = [1.0, 0.0, 0.0, 1.0]
GARBAGE = -7.5  # what an episode may hold as the "logprob" of a token it did not sample


def episode(index: int, layout: list[int], *, keep_gaps: bool = True, version: int = 4) -> Sample:
    """Sample `index`: a prompt and a response laid out as `layout`; keep_gaps false: the same
    sample with its unsampled tokens cut out (an answer with no tool turns)."""
    gen = torch.Generator().manual_seed(index)
    ids = torch.randint(5, 50, (len(layout),), generator=gen).tolist()
    logprobs = (-torch.rand(len(layout), generator=gen)).tolist()
    logprobs = [lp if m else GARBAGE for lp, m in zip(logprobs, layout)]
    keep = [i for i, m in enumerate(layout) if m or keep_gaps]
    return Sample(
        prompt_id=f"p{index // 2}",
        group_id=f"g{index // 2}",
        index=index % 2,
        prompt_ids=[1, 2, 3 + index],
        response_ids=[ids[i] for i in keep],
        rollout_logprobs=[logprobs[i] for i in keep],
        finish_reason="stop",
        weight_version=str(version),
        reward=REWARDS[index],
        loss_mask=[layout[i] for i in keep] if keep_gaps else None,
    )


def groups(keep_gaps: bool = True) -> list[Group]:
    samples = [episode(i, layout, keep_gaps=keep_gaps) for i, layout in enumerate(LAYOUTS)]
    return [Group(f"p{k}", f"g{k}", samples[2 * k : 2 * k + 2]) for k in range(2)]


def batch_of(keep_gaps: bool = True):
    return groups_to_batch(groups(keep_gaps), advantage=AdvantageOptions())


def hand_mask() -> torch.Tensor:
    width = max(3 + len(layout) for layout in LAYOUTS)
    mask = torch.zeros(len(LAYOUTS), width)
    for row, layout in enumerate(LAYOUTS):
        mask[row, 3 : 3 + len(layout)] = torch.tensor(layout, dtype=torch.float32)
    return mask


def test_the_batch_mask_is_the_loss_mask_and_tool_tokens_carry_no_logprob_or_version():
    batch = batch_of()
    assert torch.equal(batch.response_mask, hand_mask())
    tool = (hand_mask() == 0) & (torch.arange(hand_mask().shape[1]) >= 3)
    assert (batch.token_versions[tool] == -1).all() and (batch.token_versions[hand_mask() > 0] == 4).all()
    assert (batch.rollout_logprobs[tool] == 0).all() and (batch.rollout_logprobs[hand_mask() > 0] < 0).all()


def test_a_loss_mask_of_the_wrong_length_is_refused_naming_the_sample():
    bad = episode(0, LAYOUTS[0])
    bad.loss_mask = bad.loss_mask[:-1]
    with pytest.raises(ValueError, match="sample g0/0: loss_mask must hold one 0 or 1 per response token"):
        groups_to_batch([Group("p0", "g0", [bad, episode(1, LAYOUTS[1])])], advantage=AdvantageOptions())


def _compacted(values: torch.Tensor, gap_mask: torch.Tensor, compact_mask: torch.Tensor) -> torch.Tensor:
    """values at the gap batch's sampled positions, moved to the compact batch's."""
    out = torch.zeros_like(compact_mask)
    out[compact_mask > 0] = values[gap_mask > 0]
    return out


SEQ_IS = RolloutCorrection(is_level="sequence", is_upper=3.0)
CASES = {
    "grpo-token-mean": dict(kind="grpo", agg="token-mean"),
    "grpo-seq-mean-token-mean-tis": dict(kind="grpo", agg="seq-mean-token-mean", correction=RolloutCorrection()),
    "dr-grpo": dict(kind="grpo", agg="seq-mean-token-sum-norm", agg_normalizer=16.0),
    "gspo": dict(kind="gspo", agg="seq-mean-token-mean"),
    "gspo-token-mean-dual-clip": dict(kind="gspo", agg="token-mean", clip_ratio_c=3.0),
    "minirl": dict(kind="minirl", agg="token-mean"),
    "rec": dict(kind="rec", agg="token-mean"),
    "opmd": dict(kind="opmd", agg="seq-mean-token-mean"),
    "seq-is-seq-rejection": dict(
        kind="grpo",
        agg="token-mean",
        correction=RolloutCorrection(is_level="sequence", is_upper=3.0, rejection=parse_rejection("seq_mean_k3", 0.05)),
    ),
    "geometric-is-batch-normalised": dict(
        kind="grpo", agg="token-mean", correction=RolloutCorrection(is_level="geometric", batch_normalize=True)
    ),
    "bypass-reinforce": dict(
        kind="grpo", agg="token-mean", correction=RolloutCorrection(bypass=True, bypass_loss="reinforce")
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_loss_gradient_and_metrics_with_tool_gaps_equal_those_with_the_gaps_cut_out(case):
    options = {"clip_low": 0.2, "clip_high": 0.28, **CASES[case]}
    gap, compact = batch_of(keep_gaps=True), batch_of(keep_gaps=False)
    gen = torch.Generator().manual_seed(0)
    current = -torch.rand(gap.response_mask.shape, generator=gen)
    old = current + 0.3 * torch.randn(current.shape, generator=gen)
    # at the tool tokens: values that would move every number were they counted
    current = torch.where(gap.response_mask > 0, current, torch.full_like(current, -0.01))
    old = torch.where(gap.response_mask > 0, old, torch.full_like(old, -9.0))
    gap_logprobs = current.clone().requires_grad_()
    compact_logprobs = _compacted(current, gap.response_mask, compact.response_mask).requires_grad_()
    results = []
    for batch, logprobs in ((gap, gap_logprobs), (compact, compact_logprobs)):
        compact_old = old if batch is gap else _compacted(old, gap.response_mask, compact.response_mask)
        loss, metrics = policy_loss(
            logprobs,
            compact_old,
            batch.advantages,
            batch.response_mask,
            rollout_logprobs=batch.rollout_logprobs,
            **options,
        )
        loss.backward()
        results.append((loss, metrics, step_normalizer(batch, options["agg"])))
    (gap_loss, gap_metrics, gap_norm), (compact_loss, compact_metrics, compact_norm) = results
    assert float(gap_loss.detach()) == pytest.approx(float(compact_loss.detach()), rel=1e-6, abs=1e-7)
    assert gap_norm == compact_norm
    assert gap_metrics.keys() == compact_metrics.keys()
    for key in gap_metrics:
        assert float(gap_metrics[key]) == pytest.approx(float(compact_metrics[key]), rel=1e-5, abs=1e-6), key
    grad = gap_logprobs.grad
    assert grad is not None and compact_logprobs.grad is not None
    assert (grad[gap.response_mask == 0] == 0).all()  # no gradient reaches a tool token
    assert torch.allclose(grad[gap.response_mask > 0], compact_logprobs.grad[compact.response_mask > 0], atol=1e-7)
    assert grad.abs().sum() > 0


def test_gspo_sequence_ratio_is_the_mean_log_ratio_over_sampled_tokens_only():
    batch, sampled = batch_of(), hand_mask() > 0
    # every sampled token's log-ratio is 0.1, every other one's 2.0: each sequence's ratio is exp(0.1)
    log_ratio = torch.where(sampled, torch.tensor(0.1), torch.tensor(2.0))
    ratio = _sequence_ratio(log_ratio, torch.zeros_like(log_ratio), batch.response_mask)
    assert torch.allclose(ratio[sampled], torch.tensor(0.1).exp())


def test_response_length_counts_sampled_tokens_and_truncation_is_the_episodes_finish_reason():
    episodes = groups()
    episodes[0].samples[0].finish_reason = "length"  # the episode's last turn was cut
    metrics = response_length_metrics(episodes)
    sampled = sorted(sum(layout) for layout in LAYOUTS)  # 5, 6, 4, 3
    assert metrics["response_length/mean"] == sum(sampled) / 4
    assert metrics["response_length/max"] == max(sampled)
    assert metrics["response_length/p50"] == sampled[1]
    assert metrics["response_length/truncated"] == 0.25
    assert metrics["response_length/unsampled_mean"] == sum(len(x) - sum(x) for x in LAYOUTS) / 4
    plain = response_length_metrics(groups(keep_gaps=False))  # the same answers without tool turns
    for key in ("mean", "p50", "p95", "max"):
        assert plain[f"response_length/{key}"] == metrics[f"response_length/{key}"]


def test_tool_tokens_are_no_stale_tokens():
    """A sample whose tool turn came back while an older policy's tokens surround it: only its
    sampled tokens' versions count (the tool tokens have none)."""
    sample = episode(0, LAYOUTS[0], version=3)
    sample.weight_versions = [{"version": 1, "start": 0, "end": 7}, {"version": 3, "start": 7, "end": 9}]
    other = episode(1, [1, 1], version=3)
    batch = groups_to_batch([Group("p0", "g0", [sample, other])], advantage=AdvantageOptions())
    metrics = staleness_metrics(batch, policy_version=3)
    behind = [2, 2, 2, 0, 0] + [0, 0]  # the first turn (version 1) and the second turn (3), then the other sample
    assert metrics["staleness/mean"] == pytest.approx(sum(behind) / len(behind))
    assert metrics["staleness/max"] == 2 and metrics["staleness/mixed_version_share"] == 0.5


@pytest.mark.parametrize("packed", [False, True], ids=["budget", "packed"])
def test_token_budget_micro_batches_keep_the_masks_aligned(packed):
    """A row costs the positions up to its last sampled token (a trailing tool turn changes no
    loss, so it is not computed); the gaps inside stay, masked, at their positions."""
    batch = batch_of()
    micro, over = budget_micro_batches(batch, [torch.arange(batch.size)], 0, max_tokens=24, packed=packed)
    last_sampled = [3 + max(i for i, m in enumerate(layout) if m) + 1 for layout in LAYOUTS]  # 12, 14, 7, 9
    assert not over
    assert sorted(int(r) for mb in micro for r in mb.rows) == list(range(batch.size))
    for mb in micro:
        width = mb.data.input_ids.shape[1]
        assert width == max(last_sampled[r] for r in mb.rows)
        assert torch.equal(mb.data.response_mask, batch.response_mask[mb.rows, :width])
        if packed:
            assert mb.packed is not None
            assert mb.packed.lengths.tolist() == [last_sampled[r] for r in mb.rows]
            expected = torch.cat([batch.response_mask[r, : last_sampled[r]] for r in mb.rows])
            assert torch.equal(pack(mb.data.response_mask, mb.packed)[0], expected)
            values = torch.randn(1, mb.packed.total)
            restored = unpack(values, mb.packed, width)
            starts = mb.packed.starts
            for i, r in enumerate(mb.rows.tolist()):
                assert torch.equal(
                    restored[i, 1 : last_sampled[r]], values[0, starts[i] + 1 : starts[i] + last_sampled[r]]
                )
    assert sum(float(mb.data.response_mask.sum()) for mb in micro) == sum(sum(x) for x in LAYOUTS)
