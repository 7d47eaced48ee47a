"""The response-length metrics of every RL step: mean, median, p95, max, truncated share."""

import pytest

from megatron_rlvr.batching import response_length_metrics
from megatron_rlvr.samples import Group, Sample


def sample(length: int, finish: str = "stop") -> Sample:
    return Sample("p", "g", 0, [1, 2], list(range(length)), [0.0] * length, finish, "1")


def test_lengths_and_truncation_of_the_samples_a_step_trains_on():
    groups = [
        Group("p", "g", [sample(n) for n in (4, 8, 6, 2)]),
        Group("q", "h", [sample(n) for n in (10, 12, 14)] + [sample(256, "length")]),
    ]
    m = response_length_metrics(groups)
    assert m["response_length/mean"] == pytest.approx((4 + 8 + 6 + 2 + 10 + 12 + 14 + 256) / 8)
    assert m["response_length/p50"] == 8  # the lower median of 2 4 6 8 10 12 14 256
    assert m["response_length/p95"] == m["response_length/max"] == 256
    assert m["response_length/truncated"] == 1 / 8
    assert response_length_metrics([]) == {}
