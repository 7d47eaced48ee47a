"""Supervised fine-tuning: the assistant-token mask, the loss against a hand computation, the
step against HF transformers' own, the layouts against world 1, token-budget batches, the data
formats, the exported cold start as an RL run's model, and the output folders the command
refuses (its checkpoints killed mid-save: tests/test_checkpoints.py)."""

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from megatron_rlvr.config import PromptFormat, load_config
from megatron_rlvr.config.sft import SftConfig
from megatron_rlvr.data import build_arithmetic_tokenizer
from megatron_rlvr.data.long_answers import CHARS
from megatron_rlvr.data.records import DataError
from megatron_rlvr.sft.data import (
    ConversationRenderer,
    Example,
    load_conversations,
    pack_micro_batches,
    step_batches,
)

REPO = Path(__file__).resolve().parents[1]
SFT = REPO / "configs" / "long-answers-sft-cpu.yaml"
LAYOUTS = {"tp2-sp": ["parallel.tp=2"], "ep2": ["parallel.ep=2"], "pp2": ["parallel.pp=2"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_arithmetic_tokenizer(tmp_path_factory.mktemp("tok"), CHARS)


def test_only_the_assistant_tokens_are_masked(tokenizer):
    renderer = ConversationRenderer(tokenizer, PromptFormat())
    example = renderer.example([{"role": "user", "content": "9%4="}, {"role": "assistant", "content": "9-4=5"}])
    # "<bos>9%4=" then "9-4=5<eos>": the response and its end token are the targets
    assert tokenizer.decode(example.ids) == "<bos>9%4=9-4=5<eos>"
    assert example.mask == [0] * 5 + [1] * 6


def test_every_assistant_turn_of_a_conversation_is_masked_and_nothing_else(tokenizer):
    renderer = ConversationRenderer(tokenizer, PromptFormat(system_prompt="0"))
    conversation = [
        {"role": "user", "content": "8%3="},
        {"role": "assistant", "content": "#### 2"},
        {"role": "user", "content": "5%5="},
        {"role": "assistant", "content": "#### 0"},
    ]
    example = renderer.example(conversation)
    text = [tokenizer.decode([i]) for i in example.ids]
    trained = "".join(t for t, m in zip(text, example.mask) if m)
    assert "".join(text) == "<bos>08%3=#### 2<eos>5%5=#### 0<eos>"  # the system prompt renders first
    assert trained == "#### 2<eos>#### 0<eos>"


def test_conversations_load_from_messages_and_prompt_response_files(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "1%2="}, {"role": "assistant", "content": "#### 1"}]}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.jsonl").write_text(json.dumps({"q": "3%2=", "extra": {"a": "3-2=1 #### 1"}}) + "\n")
    messages = SftConfig.model_validate({"data": {"type": "file", "path": str(tmp_path / "m.jsonl")}})
    pairs = SftConfig.model_validate(
        {
            "data": {
                "type": "file",
                "path": str(tmp_path / "p.jsonl"),
                "format": "prompt_response",
                "prompt_key": "q",
                "response_key": "extra.a",
            }
        }
    )
    assert [c.messages for c in load_conversations(messages, 0)] == [rows[0]["messages"]]
    assert [c.messages for c in load_conversations(pairs, 0)] == [
        [{"role": "user", "content": "3%2="}, {"role": "assistant", "content": "3-2=1 #### 1"}]
    ]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    bad = SftConfig.model_validate({"data": {"type": "file", "path": str(tmp_path / "bad.jsonl")}})
    with pytest.raises(DataError, match=r"bad.jsonl:1: no assistant message"):
        load_conversations(bad, 0)


def test_micro_batches_stay_within_the_token_budget_and_hold_every_row():
    examples = [Example(list(range(n)), [1] * n) for n in (3, 40, 7, 19, 19, 2, 33, 8)]
    micro = pack_micro_batches(examples, micro_batch_tokens=48, pad_id=0)
    assert all(mb.input_ids.numel() <= 48 for mb in micro)
    assert sorted(int(n) for mb in micro for n in mb.response_mask.sum(-1)) == sorted(len(e) for e in examples)
    steps = step_batches(examples, batch_tokens=60, steps=6, seed=3)
    assert all(sum(len(e) for e in b) <= 60 or len(b) == 1 for b in steps)
    assert steps == step_batches(examples, batch_tokens=60, steps=6, seed=3)  # a resume takes the same
    first_epoch = [id(e) for b in steps for e in b][: len(examples)]
    assert sorted(first_epoch) == sorted(id(e) for e in examples)


def test_packed_micro_batches_hold_every_example_once_and_pad_only_row_ends():
    examples = [Example([n] * n, [1] * n) for n in (3, 40, 7, 19, 19, 2, 33, 8)]
    micro = pack_micro_batches(examples, micro_batch_tokens=96, pad_id=0, packed=True, row_tokens=48)
    # 131 tokens in the fewest rows of 48 (first-fit decreasing: 3), two rows a micro-batch
    assert [mb.size for mb in micro] == [2, 1]
    assert all(mb.input_ids.shape[1] <= 48 for mb in micro)
    pieces, padding = [], 0
    for mb in micro:
        for row in range(mb.size):
            segments = mb.segments[row]
            pad = segments == -1
            assert not mb.response_mask[row, pad].any() and (mb.input_ids[row, pad] == 0).all()
            if pad.any():  # padding only after the row's last example
                assert pad[int(pad.nonzero()[0]) :].all()
            padding += int(pad.sum())
            for segment in segments[~pad].unique_consecutive():
                where = segments == segment
                ids = mb.input_ids[row, where]
                assert (ids == len(ids)).all()  # one example, whole
                # an example's first position is no target (the padded layout's position 0)
                assert mb.response_mask[row, where].tolist() == [0] + [1] * (len(ids) - 1)
                pieces.append(len(ids))
    assert sorted(pieces) == sorted(len(e) for e in examples)
    assert padding == sum(mb.input_ids.numel() for mb in micro) - 131
    one_row = pack_micro_batches(examples, micro_batch_tokens=48, pad_id=0, packed=True)
    assert [mb.size for mb in one_row] == [1, 1, 1]  # row_tokens defaults to the micro-batch


@pytest.fixture(scope="module")
def world1(tiny_hf_dir, tmp_path_factory):
    return run_ranks(1, ["sft", str(tiny_hf_dir)], tmp_path_factory.mktemp("sft-world1"))[0]


def test_sft_loss_is_the_masked_cross_entropy_and_the_export_is_the_trained_model(world1):
    assert world1["heldout"]["sft_loss"] == pytest.approx(world1["by_hand"], abs=1e-5)
    assert world1["metrics"]["sft_loss"] == pytest.approx(world1["by_hand"], abs=1e-5)
    assert world1["metrics"]["grad_norm"] > 0
    assert world1["export_vs_learner"] <= 1e-4  # HF transformers on the export = the learner


def test_an_sft_step_is_hf_transformers_own_training_step(world1, tiny_hf_dir):
    """The learner's world-1 SFT step against the same step in HF transformers' own model: the
    masked cross-entropy's gradient norm, and the logprobs after one Adam step with the run's
    settings (clipped as the learner clips). A learner whose gradient or update differs from
    HF's would learn differently while its forward still matched."""
    from learner_worker import BASE, fixed_batch, token_logprobs
    from tiny_families import hf_model

    trainer = load_config(None, BASE).trainer
    model = hf_model(str(tiny_hf_dir))
    model.train()
    batch = fixed_batch(model.config.vocab_size)
    before = token_logprobs(model, batch.input_ids)
    (-(before * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.grad_clip)
    torch.optim.Adam(model.parameters(), lr=trainer.lr, betas=(0.9, trainer.adam_beta2), eps=1e-8).step()
    with torch.no_grad():
        after = token_logprobs(model, batch.input_ids)
    assert world1["metrics"]["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-5)
    moved = (after - before.detach())[:, 1:].abs().max()
    assert moved > 0.1  # the step is large enough to tell updates apart
    assert (after - torch.tensor(world1["logprobs_after_step"]))[:, 1:].abs().max() <= 1e-3 * moved


def test_the_cold_start_is_an_rl_runs_model(world1):
    cfg = load_config(REPO / "configs" / "long-answers-cpu.yaml", [f"model.path={world1['exported']}"])
    assert cfg.model.path == world1["exported"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_sft_step_in_two_process_layouts_equals_world1(layout, world1, tiny_hf_dir, tmp_path):
    for rank, r in enumerate(run_ranks(2, ["sft", str(tiny_hf_dir), *LAYOUTS[layout]], tmp_path)):
        assert r["heldout"]["sft_loss"] == pytest.approx(world1["heldout"]["sft_loss"], abs=1e-5), rank
        assert r["metrics"]["sft_loss"] == pytest.approx(world1["metrics"]["sft_loss"], abs=1e-5), rank
        assert r["metrics"]["grad_norm"] == pytest.approx(world1["metrics"]["grad_norm"], rel=1e-5), rank
        after = torch.tensor(r["logprobs_after_step"]) - torch.tensor(world1["logprobs_after_step"])
        assert after.abs().max() <= 1e-5, rank


@pytest.mark.parametrize("layout", ["world1", "pp2"])
def test_a_packed_sft_step_equals_the_padded_one(layout, world1, tiny_hf_dir, tmp_path):
    """sft.pack_sequences: the same rows back to back in four rows, two a micro-batch, under a
    block-diagonal causal mask give the padded step's loss, gradient and update (world 1, and pipeline parallel, whose
    stages pass the packed rows' activations)."""
    world, extra = (1, []) if layout == "world1" else (2, LAYOUTS[layout])
    for rank, r in enumerate(run_ranks(world, ["sft-packed", str(tiny_hf_dir), *extra], tmp_path)):
        assert r["heldout"]["sft_loss"] == pytest.approx(world1["by_hand"], abs=1e-5), rank
        assert r["metrics"]["sft_loss"] == pytest.approx(world1["metrics"]["sft_loss"], abs=1e-5), rank
        assert r["metrics"]["grad_norm"] == pytest.approx(world1["metrics"]["grad_norm"], rel=1e-5), rank
        after = torch.tensor(r["logprobs_after_step"]) - torch.tensor(world1["logprobs_after_step"])
        assert after.abs().max() <= 1e-5, rank


def test_sft_refuses_a_folder_that_holds_a_run_and_changes_nothing_in_it(tmp_path):
    """As train does: a new run never writes over an old one's metrics or checkpoints; resuming
    an older version's in-place checkpoint (sft_checkpoint/) is refused rather than started afresh."""
    from megatron_rlvr.config import ConfigError
    from megatron_rlvr.run_dir import CheckpointError
    from megatron_rlvr.sft.command import run_sft
    from megatron_rlvr.stopping import StopSignals

    out = tmp_path / "run"
    (out / "sft_checkpoint").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 3, "train/sft_loss": 1.0}\n')
    args = [f"trainer.output_dir={out}", "trainer.steps=2", "trainer.warmup_steps=0"]
    with pytest.raises(ConfigError, match=r"holds a run \(metrics up to step 3\): continue it with trainer.resume"):
        run_sft(str(SFT), args, StopSignals())
    with pytest.raises(CheckpointError, match=r"sft_checkpoint is a checkpoint of an older version") as refused:
        run_sft(str(SFT), [*args, "trainer.resume=true"], StopSignals())
    assert "\n" not in str(refused.value)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "sft_checkpoint"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 3, "train/sft_loss": 1.0}\n'
