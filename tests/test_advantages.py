import pytest
import torch

from megatron_rlvr.algo.advantages import group_advantages


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
