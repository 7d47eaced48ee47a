"""The judge tests' model and records: a tiny random Qwen3-MoE with a character tokenizer that
writes every printable character (so `Score: N` is one token per character) and a context
long enough for the judge's templates."""

from __future__ import annotations

import json
import string
from pathlib import Path

from megatron_rlvr.config import TinyModel
from megatron_rlvr.data.arithmetic import build_arithmetic_tokenizer
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.tiny_model import build_tiny_hf_model

KEY = "the-runs-judge-key"
SCORE = r"Score: (10|[1-9])"  # what the default range (1..10) allows


def build_judge_model(out: Path) -> Path:
    tokenizer = build_arithmetic_tokenizer(out, chars=string.ascii_letters + string.digits + string.punctuation + " \n")
    build_tiny_hf_model(TinyModel(), out, 128, tokenizer=tokenizer)  # 100 tokens, rounded up
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # the templates are ~400 characters
    (out / "config.json").write_text(json.dumps(config))
    return out


def record(prompt: str, answer: str | None) -> PromptRecord:
    return PromptRecord("p0", [{"role": "user", "content": prompt}], answer, "judge", "chat")
