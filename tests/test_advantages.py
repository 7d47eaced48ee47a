import pytest
import torch

from megatron_rlvr.algo.advantages import group_advantages
from megatron_rlvr.algo.baselines import AdvantageOptions, EmaBaselines, advantages_of_groups


def test_grpo_matches_hand_worked_example():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    std = (1.0 / 3.0) ** 0.5
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6)
    torch.testing.assert_close(group_advantages(rewards, normalize_std=True), expected)


def test_dr_grpo_is_centered_only():
    rewards = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 6.0]])
    expected = torch.tensor([[1.0, -1.0, 0.0], [-2.0, -2.0, 4.0]])
    torch.testing.assert_close(group_advantages(rewards, normalize_std=False), expected)


def test_groups_are_independent():
    a = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    b = torch.tensor([[5.0, 2.0, 9.0, 0.0]])
    both = group_advantages(torch.cat([a, b]), normalize_std=True)
    torch.testing.assert_close(both[0], group_advantages(a, normalize_std=True)[0])
    torch.testing.assert_close(both[1], group_advantages(b, normalize_std=True)[0])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_of_one_gets_zero(normalize_std):
    adv = group_advantages(torch.tensor([[1.0], [0.0]]), normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros(2, 1))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_all_equal_rewards_give_zero_not_nan(normalize_std):
    adv = group_advantages(torch.full((3, 8), 0.7), normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv, torch.zeros(3, 8))


def test_eps_is_used():
    rewards = torch.tensor([[0.0, 2.0]])  # std = sqrt(2)
    adv = group_advantages(rewards, normalize_std=True, eps=1.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]) / (2**0.5 + 1.0))


def test_integer_rewards_and_bad_shape():
    adv = group_advantages(torch.tensor([[1, 0]]), normalize_std=False)
    assert adv.dtype == torch.float32
    with pytest.raises(ValueError, match="groups, samples"):
        group_advantages(torch.ones(4), normalize_std=True)


# ----------------------------------------------------------------------------- baselines


def _ragged_groups(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 3, (n,), generator=gen).double() * 0.5 + torch.rand(n, generator=gen).double()
            for n in (2, 3, 5, 8)]  # fmt: skip


@pytest.mark.parametrize("normalize_std", [True, False])
def test_default_is_bit_identical_to_the_group_mean_formula(normalize_std):
    """Today's GRPO advantages, written out: the default options change no bit."""
    for group in _ragged_groups(0) + [torch.tensor([0.7] * 4), torch.tensor([1.0, 0.0, 0.0, 1.0])]:
        shifted = group - group[:1]
        centred = shifted - shifted.mean()
        expected = centred / (shifted.std(unbiased=True) + 1e-6) if normalize_std else centred
        (ours,) = advantages_of_groups([group], AdvantageOptions(normalize_std=normalize_std))
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_baselines_equal_their_closed_forms(normalize_std):
    for group in _ragged_groups(1):
        n = group.shape[0]
        std = group.std(unbiased=True) + 1e-6 if normalize_std else 1.0
        others = torch.stack([torch.cat([group[:i], group[i + 1 :]]).mean() for i in range(n)])
        tau = 0.3
        expected = {
            "group_mean": group - group.mean(),
            "group_median": group - group.sort().values[(n - 1) // 2],
            "rloo": group - others,
            "log_avg_exp": group - tau * torch.log(torch.exp(group / tau).mean()),
        }
        torch.testing.assert_close(expected["rloo"], n / (n - 1) * (group - group.mean()))
        for kind, centred in expected.items():
            options = AdvantageOptions(baseline_type=kind, normalize_std=normalize_std, tau=tau)
            (ours,) = advantages_of_groups([group], options)
            torch.testing.assert_close(ours, centred / std, atol=1e-12, rtol=1e-12)


def test_log_avg_exp_runs_from_the_mean_to_the_max():
    group = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    hot = advantages_of_groups([group], AdvantageOptions(baseline_type="log_avg_exp", normalize_std=False, tau=1e3))
    cold = advantages_of_groups([group], AdvantageOptions(baseline_type="log_avg_exp", normalize_std=False, tau=1e-3))
    torch.testing.assert_close(hot[0], group - group.mean(), atol=1e-3, rtol=0)
    torch.testing.assert_close(cold[0], group - 1.0, atol=1e-3, rtol=0)


def test_asymre_shift_moves_the_baseline_below_the_mean():
    group = torch.tensor([1.0, 0.0, 0.0, 0.0])
    (ours,) = advantages_of_groups([group], AdvantageOptions(normalize_std=False, shift=-0.1))
    torch.testing.assert_close(ours, torch.tensor([0.85, -0.15, -0.15, -0.15]))


def test_reward_scale_then_clip():
    group = torch.tensor([4.0, -3.0, 0.5])
    options = AdvantageOptions(normalize_std=False, reward_scale=0.5, reward_clip=1.0)
    (ours,) = advantages_of_groups([group], options)
    shaped = torch.tensor([1.0, -1.0, 0.25])
    torch.testing.assert_close(ours, shaped - shaped.mean())


def test_ema_baseline_per_prompt_and_its_state_round_trips():
    options = AdvantageOptions(baseline_type="exponential_moving_average", normalize_std=False, ema_decay=0.75)
    state = EmaBaselines()
    first = advantages_of_groups([torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])], options,
                                 prompt_ids=["a", "b"], ema=state)  # fmt: skip
    # the first time a prompt is seen its baseline is its own group mean
    torch.testing.assert_close(torch.cat(first), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert state.values == {"a": 0.5, "b": 1.0}
    restored = EmaBaselines.from_dict(state.to_dict())
    second = advantages_of_groups([torch.tensor([1.0, 1.0])], options, prompt_ids=["a"], ema=restored)
    torch.testing.assert_close(second[0], torch.tensor([0.5, 0.5]))  # against the EMA 0.5
    assert restored.values["a"] == pytest.approx(0.75 * 0.5 + 0.25 * 1.0)
    assert state.values["a"] == 0.5  # the restored copy is independent
    with pytest.raises(ValueError, match="needs prompt_ids"):
        advantages_of_groups([torch.ones(2)], options)


def test_unknown_baseline_is_refused():
    with pytest.raises(ValueError, match="baseline_type='max'"):
        advantages_of_groups([torch.ones(2)], AdvantageOptions(baseline_type="max"))
