import math

import pytest
import torch

from megatron_rlvr.algo.metrics import kl_estimate, masked_mean, mismatch_metrics, routing_agreement


def test_masked_mean_ignores_masked_garbage():
    values = torch.tensor([[1.0, 3.0, float("nan")], [float("inf"), 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(3.0)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_kl_estimators_closed_form():
    log_ratio = torch.tensor([[math.log(2.0), math.log(0.5)]])
    mask = torch.ones(1, 2)
    k1 = kl_estimate(log_ratio, mask, "k1").item()
    k2 = kl_estimate(log_ratio, mask, "k2").item()
    k3 = kl_estimate(log_ratio, mask, "k3").item()
    assert k1 == pytest.approx(0.0, abs=1e-7)
    assert k2 == pytest.approx(0.5 * math.log(2) ** 2)
    assert k3 == pytest.approx(((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2)


def test_k3_is_unbiased_for_true_kl():
    # q = N-sampled categorical; E_q[k3(p/q)] = KL(q||p)
    torch.manual_seed(0)
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.2, 0.5, 0.3])
    samples = torch.multinomial(q, 200_000, replacement=True)
    log_ratio = (p.log() - q.log())[samples].unsqueeze(0)
    estimate = kl_estimate(log_ratio, torch.ones_like(log_ratio), "k3").item()
    true_kl = (q * (q / p).log()).sum().item()
    assert estimate == pytest.approx(true_kl, rel=0.02)


def test_mismatch_metrics():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    train = torch.tensor([[-1.1, -2.0, -2.5]])
    m = mismatch_metrics(rollout, train, torch.tensor([[1, 1, 0]]))
    assert m["mismatch_abs_mean"].item() == pytest.approx(0.05)
    assert m["mismatch_abs_max"].item() == pytest.approx(0.1)
    assert m["mismatch_k3_kl"].item() == pytest.approx((math.exp(-0.1) - 1 + 0.1) / 2, rel=1e-5)


def test_routing_agreement_ignores_order_and_counts_overlap():
    a = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]]])  # [tokens=2, layers=2, k=2]
    b = torch.tensor([[[1, 0], [2, 1]], [[0, 3], [3, 2]]])
    out = routing_agreement(a, b)
    torch.testing.assert_close(out["per_layer_exact"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(out["per_layer_overlap"], torch.tensor([0.75, 0.75]))
    masked = routing_agreement(a, b, mask=torch.tensor([1, 0]))
    torch.testing.assert_close(masked["per_layer_exact"], torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="tokens, layers, k"):
        routing_agreement(a, b[:, :1])
