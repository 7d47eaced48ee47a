"""The CPU engine batches continuously, and a sequence can span two weight versions.

In process (CpuEngine itself, no server): newcomers join a running batch and finish before
the long sequence they joined; their logprobs and routing still equal HF's teacher-forced
ones and their tokens do not depend on the batch they ran in. A sequence paused mid-way
(in_place: KV kept; retract: KV recomputed) and continued under new weights carries the
version of every token, and each token's logprob equals HF's under the weights that
computed it."""

import time

import numpy as np
import pytest
import torch
from engine_fixtures import hf_teacher_forced

from megatron_rlvr.rollout.cpu_engine import CpuEngine, expert_weight_table
from megatron_rlvr.rollout.protocol import SamplingParams
from megatron_rlvr.rollout.server import WeightUpdates

# fp32 KV-cached decoding against HF's full teacher-forced forward: up to 1.0e-5 seen after a few
# hundred tokens (|logprob| up to 6.5); the weights that computed a token differ by > 1e-2
LOGPROB_TOL = 5e-5


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    engine = CpuEngine(str(tiny_hf_dir))
    yield engine
    engine.stop()


def _wait_for_tokens(seq, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(seq.output_ids) < count:
        assert not seq.future.done(), "the sequence finished before it reached the point under test"
        assert time.monotonic() < deadline, f"no {count} output tokens within {timeout_s} s"
        time.sleep(0.001)


def _params(max_new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, ignore_eos=True, sampling_seed=seed)


def test_newcomers_join_a_running_batch_and_leave_it_when_done(engine, tiny_hf_dir):
    (long,) = engine.submit([3, 1, 4], _params(400, 1), "long")
    _wait_for_tokens(long, 3)
    prompts = [[5, 17, 3, 44, 9], [70, 2], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    joiners = [engine.submit(prompt, _params(6, 10 + i), f"short-{i}")[0] for i, prompt in enumerate(prompts)]
    for seq in joiners:
        seq.future.result(timeout=120)
    assert not long.future.done()  # they joined the running batch instead of waiting for its end
    long.future.result(timeout=300)
    for seq, prompt in zip(joiners, prompts):
        want_logp, want_routing = hf_teacher_forced(tiny_hf_dir, prompt, seq.output_ids, 0.7)
        assert (torch.tensor(seq.logprobs) - want_logp).abs().max() <= LOGPROB_TOL
        assert np.array_equal(np.stack(seq.routing), want_routing.numpy())
    want_logp, _ = hf_teacher_forced(tiny_hf_dir, [3, 1, 4], long.output_ids, 0.7)
    assert (torch.tensor(long.logprobs) - want_logp).abs().max() <= LOGPROB_TOL
    for i, (seq, prompt) in enumerate(zip(joiners, prompts)):  # the same seed alone: the same tokens
        (alone,) = engine.submit(prompt, _params(6, 10 + i), None)
        assert alone.future.result(timeout=60).output_ids == seq.output_ids


def _perturbed_model(tiny_hf_dir):
    """An HF model of the checkpoint with every weight moved, and the moved tensors by name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32)
    table = expert_weight_table(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in table.values():
            if tensor.is_floating_point():
                tensor.add_(0.2 * torch.randn(tensor.shape, generator=generator))
    return model, table


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_sequence_spans_two_versions_with_the_logprobs_of_each(tiny_hf_dir, mode):
    from transformers import AutoModelForCausalLM

    engine = CpuEngine(str(tiny_hf_dir), weight_version="0")
    try:
        prompt = [5, 17, 3, 44, 9]
        (seq,) = engine.submit(prompt, _params(300, 3), "spans")
        _wait_for_tokens(seq, 6)
        engine.pause(mode)
        new_model, new_table = _perturbed_model(tiny_hf_dir)
        WeightUpdates(engine).apply(list(new_table), list(new_table.values()))
        engine.weight_version = "1"
        engine.resume()
        seq.future.result(timeout=300)
    finally:
        engine.stop()
    switch = seq.versions.index("1")  # the first token computed under the new weights
    assert switch >= 6 and set(seq.versions[:switch]) == {"0"} and set(seq.versions[switch:]) == {"1"}
    old_logp, old_routing = hf_teacher_forced(tiny_hf_dir, prompt, seq.output_ids, 0.7)
    got = torch.tensor(seq.logprobs)
    fed_under_old = len(prompt) + switch - 1  # positions fed before the sync
    routing = np.stack(seq.routing)
    assert len(routing) == len(prompt) + len(seq.output_ids) - 1
    # in place, each position keeps the routing it was fed with (what R3 must replay);
    # retracted, every position is routed again under the new weights
    kept = np.array_equal(routing[:fed_under_old], old_routing[:fed_under_old].numpy())
    assert kept == (mode == "in_place")
    assert (got[:switch] - old_logp[:switch]).abs().max() <= LOGPROB_TOL
    out = seq.output_ids
    with torch.no_grad():
        if mode == "retract":  # the KV is recomputed: the new weights over the whole sequence
            logits = new_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        else:  # the KV of the tokens fed before the switch is the old weights'
            old_model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32)
            fed_before = prompt + out[: switch - 1]
            cache = old_model(torch.tensor([fed_before]), use_cache=True).past_key_values
            rest = new_model(torch.tensor([out[switch - 1 : -1]]), past_key_values=cache, use_cache=True).logits[0]
            logits = torch.cat([torch.zeros(switch, rest.shape[-1]), rest])
    new_logp = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
    assert (got[switch:] - new_logp[switch:]).abs().max() <= LOGPROB_TOL
    assert (got[switch:] - old_logp[switch:]).abs().max() > 1e-2  # the new weights did compute them
