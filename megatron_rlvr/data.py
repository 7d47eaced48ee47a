"""Prompts for RL: records from JSONL or Parquet files, or the built-in arithmetic task, and
the small tokenizer the CPU default run creates for it (nothing comes from a model hub).

A bad line or row never stops a run: it is skipped, and its line number and reason are
reported so the file can be fixed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.config import ArithmeticData, FileData


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: str
    prompt: str
    answer: str
    verifier: str = "math"


@dataclass
class LoadedPrompts:
    records: list[PromptRecord]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, why)


def arithmetic_prompts(spec: ArithmeticData) -> LoadedPrompts:
    """Sums and products of small integers, e.g. "3+4=" → "7": verifiable, and learnable by a
    tiny model in minutes."""
    rng = random.Random(spec.seed)
    records = []
    for i in range(spec.num_prompts):
        a, b = rng.randint(0, spec.max_operand), rng.randint(0, spec.max_operand)
        op = rng.choice("+*")
        records.append(PromptRecord(f"arith-{i}", f"{a}{op}{b}=", str(a + b if op == "+" else a * b)))
    return LoadedPrompts(records)


def _record(row: object, spec: FileData, where: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise ValueError("not an object")
    missing = [k for k in (spec.prompt_key, spec.answer_key) if row.get(k) in (None, "")]
    if missing:
        raise ValueError(f"missing {', '.join(repr(k) for k in missing)}")
    verifier = str(row.get("verifier") or "math")
    if verifier != "math":
        raise ValueError(f"verifier {verifier!r} is not available (available: math)")
    return PromptRecord(str(row.get("id") or where), str(row[spec.prompt_key]), str(row[spec.answer_key]), verifier)


def load_prompts(spec: FileData) -> LoadedPrompts:
    """JSONL (one object per line) or Parquet (one row per prompt) with prompt, answer and an
    optional verifier column; bad lines are skipped and listed with their numbers."""
    path = Path(spec.path)
    if not path.exists():
        raise FileNotFoundError(f"data.path = {spec.path!r}: no such file")
    loaded = LoadedPrompts([])
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        rows = ((n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip())
    for number, raw in rows:
        try:
            row = json.loads(raw) if isinstance(raw, str) else raw
            loaded.records.append(_record(row, spec, f"{path.name}:{number}"))
        except (json.JSONDecodeError, ValueError) as err:
            reason = "not valid JSON" if isinstance(err, json.JSONDecodeError) else str(err)
            loaded.skipped.append((number, reason))
    if not loaded.records:
        raise ValueError(f"data.path = {spec.path!r}: no usable prompts ({len(loaded.skipped)} lines skipped)")
    return loaded


def load_data(spec: ArithmeticData | FileData) -> LoadedPrompts:
    return arithmetic_prompts(spec) if isinstance(spec, ArithmeticData) else load_prompts(spec)


ARITHMETIC_ALPHABET = "0123456789+*-=. "


def build_arithmetic_tokenizer(out_dir: str | Path):
    """A character-level tokenizer for the arithmetic task (digits, operators, a few specials),
    saved as a transformers fast tokenizer so engines and the learner load it by path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(ARITHMETIC_ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()  # characters back to the exact string, no separators
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
