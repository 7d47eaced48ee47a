"""Prompt data as people store it: verl-layout Parquet, JSONL with chat messages, dotted keys,
several files mixed by weight; every bad file or row is one line naming file:line and what
is wrong, or a counted skip; all of it checked before a run starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlvr.config import ArithmeticData, FileData, VerifierConfig, load_config
from megatron_rlvr.data import DataError, arithmetic_prompts, build_arithmetic_tokenizer, check_inputs, load_data
from megatron_rlvr.rewards.math.verifier import verify_math

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"
VERIFIERS = VerifierConfig()


def write_verl_parquet(path: Path, rows: list[dict]) -> Path:
    """The layout verl's data_preprocess scripts write (gsm8k.py): chat messages, the ground
    truth under reward_model, the index under extra_info."""
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
                ),
            ),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def gsm8k_row(index: int, question: str, answer: str, **overrides) -> dict:
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "content": f'{question} Let\'s think step by step and output the final answer after "####".',
                "role": "user",
            }
        ],
        "ability": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"answer": f"... #### {answer}", "index": index, "question": question, "split": "train"},
    }
    row.update(overrides)
    return row


def test_a_verl_parquet_loads_with_only_the_preset_named(tmp_path):
    path = write_verl_parquet(
        tmp_path / "train.parquet",
        [
            gsm8k_row(0, "Natalia sold 48 clips in April and half as many in May. How many in all?", "72"),
            gsm8k_row(1, "Weng earns $12 an hour. How much for 50 minutes?", "10"),
        ],
    )
    cfg = load_config(TINY, ["data.type=file", f"data.path={path}", "data.format=verl"])  # dotted overrides switch kind
    assert cfg.data.answer_key == "reward_model.ground_truth" and cfg.data.id_key == "extra_info.index"
    loaded = load_data(cfg.data, cfg.verifier)
    first = loaded.records[0]
    assert [r.prompt_id for r in loaded.records] == ["0", "1"] and loaded.skipped == []
    assert first.prompt[0]["role"] == "user" and first.prompt[0]["content"].startswith("Natalia sold 48")
    assert (first.answer, first.verifier, first.data_source) == ("72", "math", "openai/gsm8k")
    assert first.extra["split"] == "train"


def test_a_parquet_written_by_verl_s_preprocessing_loads_with_the_preset():
    """tests/data/verl-gsm8k-2rows.parquet was written by HF datasets 5.2.0 the way verl's
    examples/data_preprocess/gsm8k.py writes its files (Dataset.map(process_fn,
    with_indices=True) then Dataset.to_parquet), from two GSM8K training problems."""
    cfg = load_config(
        TINY, ["data.type=file", f"data.path={REPO / 'tests/data/verl-gsm8k-2rows.parquet'}", "data.format=verl"]
    )
    records = check_inputs(cfg)["data"].records
    assert [(r.prompt_id, r.answer, r.verifier, r.data_source) for r in records] == [
        ("0", "72", "math", "openai/gsm8k"),
        ("1", "10", "math", "openai/gsm8k"),
    ]
    assert records[1].prompt == [
        {
            "role": "user",
            "content": "Weng earns $12 an hour for babysitting. Yesterday, she "
            "just did 50 minutes of babysitting. How much did she earn? Let's think step by "
            'step and output the final answer after "####".',
        }
    ]
    assert records[0].extra["answer"].endswith("#### 72") and records[0].extra["split"] == "train"


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(tmp_path):
    path = write_verl_parquet(
        tmp_path / "mixed.parquet",
        [
            gsm8k_row(0, "1+1?", "2"),
            gsm8k_row(1, "2+2?", None),
            gsm8k_row(2, "3+3?", "6", ability="chemistry"),
            gsm8k_row(3, "4+4?", "8", prompt=[{"content": "4+4?", "role": "narrator"}]),
            gsm8k_row(0, "5+5?", "10"),
        ],
    )
    strict = FileData(path=str(path), format="verl")
    strict.fill_keys()
    with pytest.raises(DataError) as err:
        load_data(strict, VERIFIERS)
    assert str(err.value) == (
        f"{path}:row 2: missing 'reward_model.ground_truth' (or set data.skip_bad_rows=true to skip bad rows)"
    )
    loaded = load_data(strict, VERIFIERS, skip_bad_rows=True)
    assert [r.prompt_id for r in loaded.records] == ["0"]
    assert loaded.skipped == [
        (f"{path}:row 2", "missing 'reward_model.ground_truth'"),
        (f"{path}:row 3", "unknown verifier 'chemistry' in 'ability' (known: math, code, ifeval)"),
        (f"{path}:row 4", "'prompt' message 0: role 'narrator' is not one of system, user, assistant, tool"),
        (f"{path}:row 5", "id '0' repeats the one at " + f"{path}:row 1"),
    ]
    mapped = VerifierConfig(by_data_source={"openai/gsm8k": "math"})  # the data_source map wins over ability
    assert len(load_data(strict, mapped, skip_bad_rows=True).records) == 2


def test_jsonl_with_strings_messages_and_dotted_keys(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        "{not json",
        json.dumps({"prompt": "2+2="}),
        "",
        json.dumps(["a", "list"]),
        json.dumps(
            {
                "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*3="}],
                "answer": 9,
                "meta": {"uid": "q-3"},
            }
        ),
        json.dumps({"prompt": [{"role": "system", "content": "no user turn"}], "answer": 1}),
        json.dumps({"prompt": "write add", "answer": {"inputs": ["1 2"], "outputs": ["3"]}, "verifier": "code"}),
        json.dumps({"prompt": "write add", "answer": {"tests": "nope"}, "verifier": "code"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    spec = FileData(path=str(path), id_key="meta.uid")
    spec.fill_keys()
    loaded = load_data(spec, VERIFIERS, skip_bad_rows=True)
    assert [(r.prompt_id, r.answer, r.verifier) for r in loaded.records] == [
        ("prompts.jsonl:1", "2", "math"),
        ("q-3", "9", "math"),
        ("prompts.jsonl:8", {"inputs": ["1 2"], "outputs": ["3"]}, "code"),
    ]
    assert loaded.records[1].prompt[0] == {"role": "system", "content": "Be brief."}
    assert [(where.rsplit(":", 1)[1], why.split(" (")[0]) for where, why in loaded.skipped] == [
        ("2", "not valid JSON"),
        ("3", "missing 'answer'"),
        ("5", "not an object"),
        ("7", "'prompt' has no user message"),
        (
            "9",
            "'answer' holds no usable code tests: an object with keys ['tests']: expected inputs/outputs, test_list, "
            "test or input/output",
        ),
    ]


def test_files_mix_by_weight(tmp_path):
    for name, n in (("a.jsonl", 10), ("b.jsonl", 40)):
        (tmp_path / name).write_text(
            "".join(json.dumps({"id": i, "prompt": f"{name} {i}", "answer": "1"}) + "\n" for i in range(n))
        )
    spec = FileData(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], weights=[3, 1], seed=1)
    spec.fill_keys()
    records = load_data(spec, VERIFIERS).records
    from_a = [r for r in records if r.prompt_id.startswith("a.jsonl:")]
    assert len(records) == 50 and len(from_a) == round(50 * 3 / 4)  # a's rows repeat to make its share
    assert {r.prompt_id for r in from_a} == {f"a.jsonl:{i}" for i in range(10)}
    assert records == load_data(spec, VERIFIERS).records  # seeded


def test_missing_empty_unreadable_files_are_one_line(tmp_path):
    def error(path, **kw) -> str:
        spec = FileData(path=str(path), **kw)
        spec.fill_keys()
        with pytest.raises(DataError) as err:
            load_data(spec, VERIFIERS, skip_bad_rows=spec.skip_bad_rows)
        return str(err.value)

    assert error(tmp_path / "missing.jsonl") == f"data.path = '{tmp_path}/missing.jsonl': no such file"
    (tmp_path / "empty.jsonl").write_text("")
    assert error(tmp_path / "empty.jsonl") == f"data.path = '{tmp_path}/empty.jsonl': the file is empty"
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert error(tmp_path / "blank.jsonl") == f"data.path = '{tmp_path}/blank.jsonl': the file holds no rows"
    (tmp_path / "fake.parquet").write_text("not parquet")
    assert error(tmp_path / "fake.parquet").startswith(f"data.path = '{tmp_path}/fake.parquet': cannot read it")
    (tmp_path / "notes.txt").write_text("x")
    assert "unsupported file type" in error(tmp_path / "notes.txt")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert error(tmp_path / "bad.jsonl", skip_bad_rows=True).startswith(
        f"data.path = '{tmp_path}/bad.jsonl': no usable prompts (1 bad rows skipped; first: "
    )


def test_the_cli_refuses_bad_data_in_one_line_before_starting_anything(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + '{"prompt": 3}\n')
    for path, message in (
        (tmp_path / "missing.jsonl", "no such file"),
        (tmp_path / "empty.jsonl", "the file is empty"),
        (tmp_path / "bad.jsonl", f"{tmp_path}/bad.jsonl:2: 'prompt' must be a string"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_rlvr.cli",
                "train",
                str(TINY),
                "data.type=file",
                f"data.path={path}",
                f"trainer.output_dir={tmp_path}/run",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("megatron-rlvr train: ") and message in done.stderr
        assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_check_inputs_reads_eval_sets_and_names_them(tmp_path):
    cfg = load_config(TINY, ["eval.sets.heldout.type=file", f"eval.sets.heldout.path={tmp_path}/nope.parquet"])
    with pytest.raises(DataError, match=rf"eval.sets.heldout.path = '{tmp_path}/nope.parquet': no such file"):
        check_inputs(cfg)
    cfg = load_config(TINY, ["eval.sets.heldout.type=arithmetic", "eval.sets.heldout.num_prompts=8"])
    assert {k: len(v.records) for k, v in check_inputs(cfg).items()} == {"data": 512, "eval.sets.heldout": 8}


def test_arithmetic_task_is_deterministic_and_verifiable():
    a = arithmetic_prompts(ArithmeticData(num_prompts=50, seed=3)).records
    assert a == arithmetic_prompts(ArithmeticData(num_prompts=50, seed=3)).records
    assert a != arithmetic_prompts(ArithmeticData(num_prompts=50, seed=4)).records
    for record in a:
        x, op, y, _ = record.prompt[0]["content"]
        assert int(record.answer) == (int(x) + int(y) if op == "+" else int(x) * int(y))
        assert verify_math(f"{record.prompt[0]['content']}{record.answer}", record.answer) == 1.0


def test_arithmetic_tokenizer_round_trips_and_renders_its_chat_template(tmp_path):
    from transformers import AutoTokenizer

    build_arithmetic_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("12*3=36", add_special_tokens=False)
    assert len(ids) == 7 and tokenizer.decode(ids) == "12*3=36"
    assert len(tokenizer) == 20 and tokenizer.eos_token_id == 2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "3", "+", "4", "="]  # the prompt of the task, as before
    conversation = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == "<bos>3+4=7<eos>"


def test_a_run_s_data_check_is_quick_and_starts_nothing(tmp_path):
    rows = [gsm8k_row(i, f"What is {i} plus {i}?", str(2 * i)) for i in range(20000)]
    path = write_verl_parquet(tmp_path / "big.parquet", rows)
    # a fresh interpreter: other tests in this session may have imported Ray or Megatron already
    probe = f"""
import os, sys, psutil
from megatron_rlvr.config import load_config
from megatron_rlvr.data import check_inputs
cfg = load_config({str(TINY)!r}, ["data.type=file", "data.path={path}", "data.format=verl"])
print(len(check_inputs(cfg)["data"].records), len(psutil.Process().children(recursive=True)),
      "ray" in sys.modules, "megatron.core" in sys.modules, os.environ.get("RAY_ADDRESS"))
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["20000", "0", "False", "False", "None"]


def test_two_files_of_one_name_keep_every_prompt_apart(tmp_path):
    """Two verl data sets, each train.jsonl with extra_info.index 0..2: six prompts under six
    ids (their file's shortest distinct path in front), both counted in the run's data/*
    metrics; a resumed sampler whose ids are not this data's refuses in one line."""
    from megatron_rlvr.config import PromptFormat
    from megatron_rlvr.data import PromptRenderer
    from megatron_rlvr.data.check import data_counts
    from megatron_rlvr.rollout.sampler import ActiveSampler, SamplerStateMismatch

    paths = []
    for name, source in (("a", "first/set"), ("b", "second/set")):
        (tmp_path / name).mkdir()
        rows = [gsm8k_row(i, f"{name}{i}", str(i), data_source=source) for i in range(3)]
        rows = [{**row, "prompt": [{"role": "user", "content": f"{i}+{len(name)}="}]} for i, row in enumerate(rows)]
        paths.append(tmp_path / name / "train.jsonl")
        paths[-1].write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = FileData(path=[str(p) for p in paths], format="verl")
    spec.fill_keys()
    loaded = load_data(spec, VERIFIERS)
    ids = [r.prompt_id for r in loaded.records]
    assert ids == [f"{d}/train.jsonl:{i}" for d in "ab" for i in range(3)]
    assert {r.data_source for r in loaded.records} == {"first/set", "second/set"}

    encoded = PromptRenderer(build_arithmetic_tokenizer(tmp_path / "tok"), PromptFormat()).encode(loaded.records)
    assert data_counts({"data": loaded}, encoded) == {
        "data/prompts": 6,
        "data/too_long": 0,
        "data/skipped_rows": 0,
        "data/prompts/a/train.jsonl": 3,
        "data/prompts/b/train.jsonl": 3,
    }

    def sampler() -> ActiveSampler:
        return ActiveSampler(None, None, loaded.records, encode=encoded.encode, decode=str, score=None)  # type: ignore[arg-type]

    state = sampler().state()
    sampler().load_state({**state, "order": ids[::-1]})  # this data's ids: resumes
    with pytest.raises(SamplerStateMismatch, match=r"names 3 prompt ids .* 'train.jsonl:0'.*trainer.resume=false"):
        sampler().load_state({**state, "order": ["train.jsonl:0", "train.jsonl:1", "train.jsonl:2"]})  # the old form

    one = FileData(path=[str(paths[0]), str(tmp_path / "a" / ".." / "a" / "train.jsonl")], format="verl")
    one.fill_keys()
    with pytest.raises(DataError, match=r"^data.path: '.*a/train.jsonl' and '.*a/train.jsonl' are the same file"):
        load_data(one, VERIFIERS)
    paths[1].write_text(paths[1].read_text() + paths[1].read_text().splitlines()[0] + "\n")
    with pytest.raises(DataError, match=r"b/train.jsonl:4: id 'b/train.jsonl:0' repeats the one at .*b/train.jsonl:1 "):
        load_data(spec, VERIFIERS)
