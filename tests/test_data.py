"""Prompt data: the arithmetic task, files with bad lines, the local tokenizer."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlvr.config import ArithmeticData, FileData
from megatron_rlvr.data import arithmetic_prompts, build_arithmetic_tokenizer, load_data, load_prompts
from megatron_rlvr.rewards.math import verify_math


def test_arithmetic_task_is_deterministic_and_verifiable():
    a = arithmetic_prompts(ArithmeticData(num_prompts=50, seed=3)).records
    assert a == arithmetic_prompts(ArithmeticData(num_prompts=50, seed=3)).records
    assert a != arithmetic_prompts(ArithmeticData(num_prompts=50, seed=4)).records
    for record in a:
        x, op, y = record.prompt[0], record.prompt[1], record.prompt[2]
        assert int(record.answer) == (int(x) + int(y) if op == "+" else int(x) * int(y))
        assert verify_math(f"{record.prompt}{record.answer}", record.answer) == 1.0


def test_jsonl_bad_lines_are_skipped_with_their_numbers(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        "{not json",
        json.dumps({"prompt": "2+2="}),
        "",
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "3*3=", "answer": 9, "verifier": "code"}),
        json.dumps({"id": "mine", "prompt": "3*3=", "answer": 9, "verifier": "math"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    loaded = load_prompts(FileData(path=str(path)))
    assert [(r.prompt_id, r.answer) for r in loaded.records] == [("prompts.jsonl:1", "2"), ("mine", "9")]
    assert loaded.skipped == [(2, "not valid JSON"), (3, "missing 'answer'"), (5, "not an object"),
                              (6, "verifier 'code' is not available (available: math)")]


def test_parquet_and_custom_keys(tmp_path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"question": ["5+5=", None], "solution": ["10", "1"]}), path)
    loaded = load_data(FileData(path=str(path), prompt_key="question", answer_key="solution"))
    assert [r.prompt for r in loaded.records] == ["5+5="] and loaded.skipped == [(2, "missing 'question'")]


def test_unusable_files_are_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path = .*no such file"):
        load_prompts(FileData(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"no usable prompts \(1 lines skipped\)"):
        load_prompts(FileData(path=str(tmp_path / "bad.jsonl")))


def test_arithmetic_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    build_arithmetic_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("12*3=36", add_special_tokens=False)
    assert len(ids) == 7 and tokenizer.decode(ids) == "12*3=36"
    assert len(tokenizer) == 20 and tokenizer.eos_token_id == 2
