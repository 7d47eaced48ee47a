"""Checkpoints as shipped: tiny checkpoints written in the FP8 block-scaled format of
DeepSeek-V3/Kimi-K2 and the MXFP4 expert format of gpt-oss read, through the reader every
load, conversion and comparison uses, as exactly the weights their dequantised originals hold.

The encoders here are written from the format definitions (see megatron_rlvr/quantized.py)
and checked against transformers' own dequantisation, so the files are the real formats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rlvr.config import TinyModel
from megatron_rlvr.learner.model import HFReader
from megatron_rlvr.quantized import FP4_E2M1, UnsupportedQuantization, dequantize_fp8_blocks, dequantize_mxfp4

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_encode(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantisation: per 128×128 block, scale_inv = amax / 448 and the
    block divided by it, rounded to float8_e4m3fn; edge blocks are partial."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    scale_inv = torch.empty(grid, dtype=torch.float32)
    quant = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale_inv[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            quant[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale_inv[i, j]).to(
                torch.float8_e4m3fn
            )
    return quant, scale_inv


def mxfp4_encode(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX format as gpt-oss ships it: the model's [..., rows, cols] tensor is stored
    transposed, in groups of 32 along rows; each group shares the exponent
    floor(log2(amax)) − 2 (e2m1's largest exponent), stored +127 in one byte, and each value
    is rounded to the nearest e2m1 code, two codes per byte, the first in the low nibble."""
    t = tensor.transpose(-1, -2).float()
    groups = t.unflatten(-1, (t.shape[-1] // 32, 32))  # [..., cols, G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(FP4_E2M1)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # nearest e2m1
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_encoders_agree_with_transformers_dequantisation():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    torch.manual_seed(0)
    weight = torch.randn(300, 200)  # 3×2 blocks, partial at both edges
    quant, scale_inv = fp8_encode(weight)
    ours = dequantize_fp8_blocks(quant, scale_inv)
    theirs = fp8._dequantize_fp8_weight(quant, scale_inv, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
    assert (ours - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    experts = torch.randn(3, 64, 96)  # [experts, rows, cols] as the gpt-oss model holds them
    blocks, scales = mxfp4_encode(experts)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs) and ours.shape == experts.shape
    rel = ((ours - experts).abs() / experts.abs().amax(1, keepdim=True)).max()
    assert rel <= 0.25  # e2m1 rounding within a shared power-of-two scale


def _rewrite(src: Path, dst: Path, quant_config: dict, encode) -> dict[str, torch.Tensor]:
    """Copies src with encode(name, tensor) → {name: tensor} applied to every tensor and
    quantization_config in config.json; returns the dequantised originals by name."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    shipped = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        shipped.update(encode(name, tensor))
    save_file(shipped, dst / "model.safetensors", metadata={"format": "pt"})
    return shipped


def test_fp8_block_checkpoint_reads_as_its_dequantised_original(tmp_path):
    """A Qwen3-MoE checkpoint with DeepSeek-V3's FP8 layout: every linear weight but the
    router's in fp8 with `weight_scale_inv`; widths 160 and 144 leave partial edge blocks."""
    from megatron_rlvr.tiny_model import build_tiny_hf_model

    spec = TinyModel(hidden_size=160, head_dim=40, moe_intermediate_size=144)
    src = build_tiny_hf_model(spec, tmp_path / "bf", vocab_size=96)
    expected = {}

    def encode(name, tensor):
        if name.endswith("proj.weight"):
            quant, scale_inv = fp8_encode(tensor)
            expected[name] = (
                quant.float()
                * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: tensor.shape[0], : tensor.shape[1]]
            )
            return {name: quant, name + "_scale_inv": scale_inv}
        expected[name] = tensor
        return {name: tensor}

    shipped = _rewrite(
        src,
        tmp_path / "fp8",
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        encode,
    )
    assert sum(t.dtype == torch.float8_e4m3fn for t in shipped.values()) > 20
    reader = HFReader(tmp_path / "fp8")
    assert reader.names() == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(reader.get(name), tensor), name


def test_mxfp4_experts_read_as_their_dequantised_original(tmp_path):
    """gpt-oss's layout: the fused expert tensors as `_blocks`/`_scales`, the rest plain."""
    src = tmp_path / "plain"
    src.mkdir()
    torch.manual_seed(0)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 96),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(4, 96),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 64),
        "model.layers.0.self_attn.sinks": torch.randn(4),
    }
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    expected = {}

    def encode(name, tensor):
        if name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = mxfp4_encode(tensor)
            expected[name] = dequantize_mxfp4(blocks, scales)
            return {name + "_blocks": blocks, name + "_scales": scales}
        expected[name] = tensor
        return {name: tensor}

    _rewrite(
        src,
        tmp_path / "mxfp4",
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
        encode,
    )
    reader = HFReader(tmp_path / "mxfp4")
    assert reader.names() == set(tensors)
    for name, tensor in expected.items():
        assert torch.equal(reader.get(name), tensor), name
        assert reader.get(name).shape == tensors[name].shape


def test_an_unknown_quant_method_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedQuantization) as err:
        HFReader(tmp_path)
    assert "'awq' is not supported (supported: fp8, mxfp4" in str(err.value) and "\n" not in str(err.value)
