"""`megatron-rlvr convert` on tiny Qwen3-MoE checkpoints of several shapes: HF → Megatron → HF
round trips bitwise at world 1 and across 2-process layouts, logits against HF transformers,
a learner started from a converted checkpoint, and the one-line refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import distributed
import pytest
import torch
from conftest import build_tiny_gpt_oss

from megatron_rlvr import run_dir
from megatron_rlvr.config import TinyModel
from megatron_rlvr.convert.checks import ConvertError
from megatron_rlvr.convert.commands import describe, hf_to_mcore, mcore_to_hf

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
SHAPES = {  # every level of every factor; top-1 only without norm_topk_prob (see the refusal test)
    "e4-top2-norm-untied": TinyModel(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "e8-top2-norm-tied": TinyModel(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True),
    "e8-top1-plain-tied": TinyModel(
        num_experts=8, num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True
    ),
    "e4-top2-plain-untied": TinyModel(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
}
FP32_LOGIT_DIFF = 1e-5


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from megatron_rlvr.data import build_arithmetic_tokenizer
    from megatron_rlvr.tiny_model import build_tiny_hf_model

    dirs = {}
    for name, spec in SHAPES.items():
        dirs[name] = build_tiny_hf_model(spec, tmp_path_factory.mktemp(name), VOCAB)
    build_arithmetic_tokenizer(dirs["e4-top2-norm-untied"])  # tokenizer files must travel along
    dirs["gpt-oss"] = build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))  # fused, interleaved experts
    return dirs


@pytest.fixture(scope="module")
def world1(sources, tmp_path_factory):
    """shape → (checkpoint, verify figures) of its HF → Megatron conversion at world 1, made
    once, when a test first asks."""
    out, done = tmp_path_factory.mktemp("mcore"), {}

    def converted(shape: str) -> tuple[Path, dict]:
        if shape not in done:
            done[shape] = out / shape, hf_to_mcore(sources[shape], out / shape)
        return done[shape]

    return converted


def _assert_round_trip(figures: dict, src: Path) -> None:
    assert figures["tensors"] == figures["bitwise_equal"] == len(_safetensors_names(src)), figures
    assert figures["max_logit_diff"] <= FP32_LOGIT_DIFF, figures


def _safetensors_names(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names.update(f.keys())
    return names


# Two shapes hold every level of every factor (experts 4/8, top-1/2, norm/plain, tied/untied):
# the other two combinations add no level and run in the slow tier.
COVERING = ("e4-top2-norm-untied", "e8-top1-plain-tied")


@pytest.mark.parametrize(
    "shape", [s if s in COVERING else pytest.param(s, marks=pytest.mark.slow) for s in SHAPES] + ["gpt-oss"]
)
def test_round_trip_at_world1_is_bitwise_and_matches_hf_logits(shape, sources, world1, tmp_path):
    ckpt, to_mcore = world1(shape)
    _assert_round_trip(to_mcore, sources[shape])
    to_hf = mcore_to_hf(ckpt, tmp_path / "hf", max_shard_mb=0.2)
    assert to_hf["round_trip"] == str(sources[shape])
    _assert_round_trip(to_hf, sources[shape])
    print(shape, *describe(to_mcore), *describe(to_hf), sep="\n  ")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    if (sources[shape] / "tokenizer.json").exists():  # tokenizer files travel both ways
        from transformers import AutoTokenizer

        ours, theirs = (AutoTokenizer.from_pretrained(d) for d in (tmp_path / "hf", sources[shape]))
        assert ours("12+3=15").input_ids == theirs("12+3=15").input_ids


@pytest.fixture(scope="module")
def tp2_ep2(sources, tmp_path_factory) -> tuple[Path, dict]:
    """The untied 4-expert shape converted by two ranks: TP=2 (+SP), EP=2, expert TP=1."""
    out = tmp_path_factory.mktemp("tp2-ep2") / "mcore"
    return out, hf_to_mcore(sources["e4-top2-norm-untied"], out, tp=2, ep=2, etp=1)


def test_two_rank_conversion_reshards_to_world1_bitwise(sources, tp2_ep2, tmp_path):
    ckpt, to_mcore = tp2_ep2
    _assert_round_trip(to_mcore, sources["e4-top2-norm-untied"])
    assert json.loads((ckpt / "convert.json").read_text())["layout"]["tp"] == 2
    _assert_round_trip(mcore_to_hf(ckpt, tmp_path / "hf"), sources["e4-top2-norm-untied"])


def test_tied_world1_checkpoint_exports_bitwise_through_two_pipeline_stages(sources, world1, tmp_path):
    ckpt, _ = world1("e8-top1-plain-tied")
    _assert_round_trip(mcore_to_hf(ckpt, tmp_path / "hf", pp=2), sources["e8-top1-plain-tied"])


def test_requested_bf16_is_bitwise_after_the_cast_and_close_to_hf_in_bf16(sources, tmp_path):
    figures = hf_to_mcore(sources["e8-top2-norm-tied"], tmp_path / "mcore", dtype="bf16")
    assert figures["tensors"] == figures["bitwise_equal"]
    assert figures["max_logit_diff"] <= figures["logit_tolerance"]
    print("bf16", *describe(figures), sep="\n  ")


def _real_looking_copy(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy with norm weights that are not all ones (a tiny model's are, and survive any cast),
    every tensor and config.json in dtype, as a checkpoint saved in that dtype is."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: (1 + 0.1 * torch.randn(t.shape, generator=generator) if name.endswith("norm.weight") else t).to(dtype)
        for name, t in _read_all(dst / "model.safetensors").items()
    }
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": str(dtype).removeprefix("torch.")}))
    return dst


def _read_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    return {name: t for f in model_dir.glob("*.safetensors") for name, t in _read_all(f).items()}


@pytest.mark.slow  # the bf16 cast itself is checked by test_requested_bf16_is_bitwise_after_the_cast (default tier)
def test_fp32_to_bf16_megatron_comes_back_bitwise_in_bf16_or_in_the_dtype_asked(sources, tmp_path):
    """As users run it: an fp32 HF checkpoint converted with --dtype bf16 and back, by the CLI."""
    src = _real_looking_copy(sources["e4-top2-norm-untied"], tmp_path / "src", torch.float32)
    source = _read_all(src / "model.safetensors")
    to_mcore = _cli("hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mcore"), "--dtype", "bf16")
    assert to_mcore.returncode == 0, to_mcore.stderr
    assert f"{len(source)}/{len(source)} tensors bitwise equal to the source in bfloat16" in to_mcore.stdout
    # default: the checkpoint's dtype, bitwise against the bf16 cast of the source
    back = _cli("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"))
    assert back.returncode == 0, back.stderr
    assert f"{len(source)}/{len(source)} tensors bitwise equal to the source in bfloat16 ({src})" in back.stdout
    written = _read_dir(tmp_path / "hf")
    assert written.keys() == source.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, source[n].to(torch.bfloat16)) for n, t in written.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    # asked for fp32: the bf16 values, widened (lossless), and config.json says so
    wide = _cli("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf32"), "--dtype", "fp32")
    assert wide.returncode == 0, wide.stderr
    assert "bitwise equal to the source in bfloat16, then float32" in wide.stdout
    assert all(
        t.dtype == torch.float32 and torch.equal(t, source[n].to(torch.bfloat16).float())
        for n, t in _read_dir(tmp_path / "hf32").items()
    )
    assert json.loads((tmp_path / "hf32" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.slow  # the bf16 cast itself is checked by test_requested_bf16_is_bitwise_after_the_cast (default tier)
def test_bf16_round_trip_is_bitwise_and_fp32_megatron_exports_bf16_when_asked(sources, tmp_path):
    src = _real_looking_copy(sources["e4-top2-norm-untied"], tmp_path / "src", torch.bfloat16)
    to_mcore = hf_to_mcore(src, tmp_path / "mcore")  # config.json says bfloat16: no --dtype needed
    to_hf = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert to_mcore["bitwise_equal"] == to_hf["bitwise_equal"] == to_hf["tensors"] > 0
    assert to_hf["dtype"] == to_hf["checkpoint_dtype"] == "bfloat16"
    source = _read_all(src / "model.safetensors")
    assert all(torch.equal(t, source[n]) for n, t in _read_dir(tmp_path / "hf").items())
    # an fp32 checkpoint written out in bf16: the bf16 cast of its fp32 source, norms included
    src32 = _real_looking_copy(sources["e4-top2-norm-untied"], tmp_path / "src32", torch.float32)
    hf_to_mcore(src32, tmp_path / "mcore32")
    narrow = mcore_to_hf(tmp_path / "mcore32", tmp_path / "narrow", dtype="bf16")
    assert narrow["bitwise_equal"] == narrow["tensors"] and narrow["max_logit_diff"] <= narrow["logit_tolerance"]
    assert narrow["compared_as"] == "float32, then bfloat16"
    source = _read_all(src32 / "model.safetensors")
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, source[n].to(torch.bfloat16))
        for n, t in _read_dir(tmp_path / "narrow").items()
    )


def test_learner_starts_from_a_converted_checkpoint_and_its_checkpoint_converts_back(
    sources, tp2_ep2, tmp_path, monkeypatch
):
    """Converted by TP2+EP2, trained at world 1 from a directory without weights, exported."""
    src = sources["e4-top2-norm-untied"]
    config_only = tmp_path / "config-only"
    shutil.copytree(tp2_ep2[0] / "hf", config_only)
    monkeypatch.setattr(distributed, "WORKER", Path(__file__).with_name("convert_worker.py"))
    learner_ckpt = tmp_path / "learner-ckpt"
    result = distributed.run_ranks(1, [str(config_only), str(tp2_ep2[0]), str(src), str(learner_ckpt)], tmp_path)[0]
    assert result["logprob_max_diff_vs_reference"] <= 1e-5 and result["export_equals_reference"]
    # the learner's own checkpoint (with optimizer state) carries no HF config: --hf-config gives it
    with pytest.raises(ConvertError, match="pass --hf-config"):
        mcore_to_hf(learner_ckpt, tmp_path / "refused")
    # as a run keeps it: a step folder, sealed, that `latest` names; --ckpt takes the run's folder
    root = tmp_path / "run" / run_dir.CHECKPOINT
    step = run_dir.begin_save(root, 1)
    learner_ckpt.rename(step / run_dir.LEARNER)
    (step / run_dir.RUN_STATE).write_bytes(run_dir.dump_run_state({"step": 1}))
    run_dir.seal(step, 1)
    run_dir.point_latest(root, step, 1)
    figures = mcore_to_hf(root, tmp_path / "hf", hf_config=config_only)
    assert figures["max_logit_diff"] <= FP32_LOGIT_DIFF and "tensors" not in figures
    trained = _read_all(tmp_path / "trained.safetensors")
    exported = {name: t for f in (tmp_path / "hf").glob("*.safetensors") for name, t in _read_all(f).items()}
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[n], trained[n]) for n in trained)


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ----------------------------------------------------------------------------- refusals
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", "convert", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def _edited_copy(src: Path, dst: Path, drop: str | None = None, add: str | None = None, **config) -> Path:
    """A copy of an HF checkpoint with one tensor dropped or added, or config.json fields changed."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = _read_all(dst / "model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(4)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    data = json.loads((dst / "config.json").read_text())
    if "num_experts" in config and "num_local_experts" in data:  # transformers 5's spelling
        data["num_local_experts"] = config.pop("num_experts")
    (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


def test_a_removed_tensor_is_named_in_one_line_exit_2(sources, tmp_path):
    missing = "model.layers.1.mlp.experts.2.down_proj.weight"
    src = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "src", drop=missing)
    out = _cli("hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "out"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"megatron-rlvr convert: tensor {missing!r} is missing from the checkpoint"
    ]
    assert not (tmp_path / "out").exists()  # a refused conversion leaves nothing behind


def test_an_unexpected_tensor_is_named(sources, tmp_path):
    extra = "model.layers.0.mlp.experts.4.up_proj.weight"
    src = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "src", add=extra)
    with pytest.raises(ConvertError, match=f"unexpected tensor {extra} in {src}"):
        hf_to_mcore(src, tmp_path / "out")


def test_a_config_that_disagrees_with_the_checkpoint_is_named(sources, world1, tmp_path):
    ckpt, _ = world1("e4-top2-norm-untied")
    other = sources["e8-top2-norm-tied"]
    with pytest.raises(ConvertError, match=r"config mismatch: num_experts = 8 in --hf-config .* but 4 in checkpoint"):
        mcore_to_hf(ckpt, tmp_path / "out", hf_config=other)
    top1 = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "top1", num_experts_per_tok=1)
    with pytest.raises(ConvertError, match="num_experts_per_tok = 1 in --hf-config"):
        mcore_to_hf(ckpt, tmp_path / "out", hf_config=top1)


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"num_experts": 8},
            r"tensor decoder\.layers\.mlp\.router\.weight is \[2, 4, 64\] in checkpoint .* but \[2, 8, 64\]",
        ),
        ({"tie_word_embeddings": True}, r"holds tensor output_layer\.weight \[96, 64\] that this model lacks"),
    ],
    ids=["experts", "tied"],
)
def test_a_checkpoint_without_its_config_is_checked_tensor_by_tensor(change, error, sources, world1, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(world1("e4-top2-norm-untied")[0], bare, ignore=shutil.ignore_patterns("hf", "convert.json"))
    config = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "config", **change)
    with pytest.raises(ConvertError, match=error):
        mcore_to_hf(bare, tmp_path / "out", hf_config=config, verify=False)


def test_top1_with_renormalised_weights_is_refused_in_one_line(sources, tmp_path):
    # every token's one expert would weigh 1 and the router get no gradient: Megatron refuses
    src = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "src", num_experts_per_tok=1)
    with pytest.raises(ConvertError, match="Megatron-Core cannot build this model: .*topk is 1"):
        hf_to_mcore(src, tmp_path / "out")


def test_unasked_rounding_is_refused_naming_a_tensor(sources, tmp_path):
    src = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "src", dtype="bfloat16")
    with pytest.raises(
        ConvertError,
        match=r"lm_head\.weight is float32 in .* declares bfloat16: "
        r"converting would round it; pass --dtype bf16",
    ):
        hf_to_mcore(src, tmp_path / "out")


def test_unsupported_architecture_and_occupied_output_are_one_line(sources, tmp_path):
    llama = _edited_copy(sources["e4-top2-norm-untied"], tmp_path / "llama", model_type="llama")
    out = _cli("hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "out"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert (
        "model_type 'llama'" in out.stderr
        and "supported: deepseek_v3, glm4_moe, gpt_oss, kimi_k2, mixtral, qwen2_moe, qwen3_moe" in out.stderr
    )
    with pytest.raises(ConvertError, match="exists and is not empty"):
        hf_to_mcore(sources["e4-top2-norm-untied"], llama)
    with pytest.raises(ConvertError, match="--ep = 3: must divide the model's 4 experts"):
        hf_to_mcore(sources["e4-top2-norm-untied"], tmp_path / "out", ep=3)


# ----------------------------------------------------------------------------- MoE families
CONVERT_FAMILIES = ["qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "moonlight", "kimi_k2"]


# DeepSeek-V3 and the kimi_k2 alias by default (Mixtral's legacy names: the weight-sync family test); the rest under `slow`
@pytest.mark.parametrize(
    "family",
    [f if f in ("deepseek_v3", "kimi_k2") else pytest.param(f, marks=pytest.mark.slow) for f in CONVERT_FAMILIES],
)
def test_each_family_round_trips_bitwise_at_world1(family, family_dir, tmp_path):
    src = family_dir(family)
    _assert_round_trip(hf_to_mcore(src, tmp_path / "mcore"), src)  # every tensor and persistent buffer
    _assert_round_trip(mcore_to_hf(tmp_path / "mcore", tmp_path / "hf"), src)
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
        == json.loads((src / "config.json").read_text())["model_type"]
    )  # kimi_k2 stays kimi_k2


@pytest.mark.parametrize(
    "family", ["deepseek_v3", *(pytest.param(f, marks=pytest.mark.slow) for f in ("mixtral", "glm4_moe"))]
)
def test_each_family_round_trips_bitwise_through_ep2(family, family_dir, tmp_path):
    src = family_dir(family)
    _assert_round_trip(hf_to_mcore(src, tmp_path / "mcore", ep=2), src)
    _assert_round_trip(mcore_to_hf(tmp_path / "mcore", tmp_path / "hf"), src)
