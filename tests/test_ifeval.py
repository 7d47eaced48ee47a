"""The ifeval verifier: IFEval's published examples get the checker library's own verdicts,
both record layouts load, binary and fraction grading, bad records are refused at load in one
line, a checker that fails is a counted reason, language detection is seeded, and nothing reaches
the network."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rlvr.config import FileData, VerifierConfig
from megatron_rlvr.data import DataError, load_data
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.rewards.registry import Verifiers

REPO = Path(__file__).resolve().parents[1]
# five of IFEval's published examples (google-research instruction_following_eval, Apache-2.0):
# input_data.jsonl's rows (key, prompt, instruction_id_list, kwargs) with GPT-4's response from
# input_response_data_gpt4_20231107_145030.jsonl
EXAMPLES = REPO / "tests" / "data" / "ifeval_examples.jsonl"
IFEVAL = VerifierConfig(kind="ifeval", timeout_s=5.0)


def _file(tmp_path: Path, rows: list[dict], name: str = "if.jsonl") -> FileData:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = FileData(path=str(path))
    spec.fill_keys()
    return spec


def _published() -> list[dict]:
    return [json.loads(line) for line in EXAMPLES.read_text().splitlines()]


def test_published_examples_get_the_library_s_own_verdicts():
    """Every example, strict and loose, binary and fraction, scored by the function the sandbox
    calls, equals if-verifiable's evaluate_output_for_sample on the same sample."""
    from if_verifiable import IFEvalSample, evaluate_output_for_sample

    from megatron_rlvr.rewards.instruction.checkers import score

    spec = FileData(path=str(EXAMPLES))
    spec.fill_keys()
    records = load_data(spec, IFEVAL).records  # Google's layout: the row's own columns
    rows = _published()
    ours, library = [], []
    for row, record in zip(rows, records):
        assert record.answer == {"instruction_id_list": row["instruction_id_list"], "kwargs": row["kwargs"]}
        _, scores = evaluate_output_for_sample(
            "ifeval",
            IFEvalSample(row["key"], row["prompt"], row["instruction_id_list"], row["kwargs"]),
            row["response"],
        )
        library.append((scores.binary_strict, scores.partial_strict, scores.binary_loose, scores.partial_loose))
        task = {"ground_truth": record.answer, "prompt": row["prompt"]}
        ours.append(
            tuple(
                score(row["response"], {**task, "grading": grading, "loose": loose})
                for loose in (False, True)
                for grading in ("binary", "fraction")
            )
        )
    assert ours == library
    # what the examples are (read by hand): 1012 has its <<title>> but does not repeat the
    # request; 1019 is lowercase; 102 has 3 bullets; 1021 has its 2 PARAGRAPH sections but is
    # not in capitals; 1051 signs with "[Your Name]", which the loose reading drops (last line)
    assert ours == [
        (0.0, 0.5, 0.0, 0.5),
        (1.0, 1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0),
        (0.0, 0.5, 0.0, 0.5),
        (0.0, 0.0, 1.0, 1.0),
    ]


def test_the_verifiers_score_if_rlvr_records_in_the_sandbox_binary_or_fraction(tmp_path):
    """IF-RLVR's layout (the ground-truth column as open-instruct writes it, IFBench and IFEval ids),
    through the run's verifiers: binary and fraction grading, reasoning stripped, every verdict
    counted by reason."""
    truth = [
        {
            "instruction_id": ["count:word_count_range", "change_case:english_lowercase"],
            "kwargs": [{"min_words": 3, "max_words": 6}, None],
        }
    ]
    as_written = [
        str(truth),  # open-instruct's files: the Python literal (single quotes, None)
        json.dumps(truth),
        [json.dumps(truth[0])],  # a list holding the set's JSON
    ]
    spec = _file(tmp_path, [{"prompt": "Describe the sea.", "answer": a, "verifier": "ifeval"} for a in as_written])
    records = load_data(spec, IFEVAL).records
    assert [r.answer for r in records] == 3 * [
        {
            "instruction_id_list": ["count:word_count_range", "change_case:english_lowercase"],
            "kwargs": [{"min_words": 3, "max_words": 6}, {}],
        }
    ]
    record = records[0]
    responses = [
        "<think>Count: The sea is...</think>the sea is wide and blue",  # both
        "The sea is wide and blue",  # the word count only
        "the sea",  # lowercase only
        "THE SEA IS A VERY BIG AND WIDE BLUE THING",  # neither
        "<think>still thinking",  # cut off while reasoning
    ]
    expected = {
        "binary": [(1.0, "all_followed"), *[(0.0, "not_followed")] * 3, (0.0, "no_response")],
        "fraction": [
            (1.0, "all_followed"),
            (0.5, "partly_followed"),
            (0.5, "partly_followed"),
            (0.0, "not_followed"),
            (0.0, "no_response"),
        ],
    }
    for grading, verdicts in expected.items():
        cfg = VerifierConfig(kind="ifeval", timeout_s=5.0, ifeval={"grading": grading})
        verifiers = Verifiers(cfg, {})
        try:
            assert verifiers.verify(responses, record) == verdicts
        finally:
            verifiers.close()


def test_bad_records_are_refused_at_load_in_one_line_naming_the_record(tmp_path):
    good = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    rows = [
        {"prompt": "a", "answer": good, "verifier": "ifeval"},
        {
            "prompt": "b",
            "answer": {"instruction_id_list": ["keywords:existence"], "kwargs": [{}]},
            "verifier": "ifeval",
        },
        {"prompt": "c", "answer": {"instruction_id_list": ["nope:x"], "kwargs": [{}]}, "verifier": "ifeval"},
        {
            "prompt": "d",
            "answer": {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"x": 1}]},
            "verifier": "ifeval",
        },
        {"prompt": "e", "answer": '{"func_name": "validate_lowercase", "N": null}', "verifier": "ifeval"},
        {
            "prompt": "f",
            "answer": {"instruction_id_list": ["punctuation:no_comma"], "kwargs": []},
            "verifier": "ifeval",
        },
        {"prompt": "g", "answer": {"instruction_id_list": ["words:start_verb"], "kwargs": [{}]}, "verifier": "ifeval"},
        {"prompt": "h", "answer": "not json", "verifier": "ifeval"},
        {"prompt": "i", "verifier": "ifeval"},
        {
            "prompt": "j",
            "answer": {
                "instruction_id_list": ["length_constraints:number_sentences"],
                "kwargs": [{"num_sentences": 3}],
            },
            "verifier": "ifeval",
        },
        {
            "prompt": "k",
            "answer": {"instruction_id_list": ["ratio:overlap"], "kwargs": [{"percentage": 50}]},
            "verifier": "ifeval",
        },
    ]
    spec = _file(tmp_path, rows)
    with pytest.raises(DataError) as err:
        load_data(spec, IFEVAL)
    assert str(err.value) == (
        f"{spec.path}:2: ifeval instructions: instruction 'keywords:existence' lacks arguments ['keywords'] "
        "(given: []) (or set data.skip_bad_rows=true to skip bad rows)"
    )
    loaded = load_data(spec, IFEVAL, skip_bad_rows=True)
    assert [r.prompt for r in loaded.records] == ["a"]
    reasons = [why.removeprefix("ifeval instructions: ") for _, why in loaded.skipped]
    assert reasons[1:] == [
        "unknown instruction id 'nope:x' (not an IFEval or IFBench id)",
        "instruction 'punctuation:no_comma': CommaChecker.build_description() got an unexpected keyword argument 'x'",
        "func_name 'validate_lowercase': Tulu 3's func_name ground truth is not read "
        "(use instruction_id + kwargs, as IFEval and IF-RLVR write them)",
        "kwargs must be a list of 1 objects, one per instruction id, got []",
        "instruction 'words:start_verb' is not supported: it needs NLTK's English part-of-speech tagger "
        "data, which no package on the index ships",
        "the ground truth is neither JSON nor a Python literal: 'not json'",
        "no instruction_id_list (IFEval) or instruction_id (IF-RLVR)",
        "instruction 'length_constraints:number_sentences' lacks arguments ['relation'] (given: ['num_sentences'])",
        "instruction 'ratio:overlap' lacks arguments ['reference_text'] (given: ['percentage'])",
    ]
    assert all("\n" not in why for _, why in loaded.skipped)


def test_a_checker_that_fails_is_a_counted_reason_not_a_silent_zero():
    """In the run's verifier pool: if-verifiable's IFBench quote checker indexes past the end
    of a response without a quote; the sandbox reports runtime_error, and the run's metrics
    count it apart from the responses the checks did score."""
    from megatron_rlvr.config import Config
    from megatron_rlvr.launch.placement import InProcess
    from megatron_rlvr.launch.verifiers import VerifierPool

    cfg = Config.model_validate({"verifier": {"kind": "ifeval", "num_workers": 1, "timeout_s": 5.0}})
    pool = VerifierPool(cfg, InProcess(cfg))
    record = PromptRecord("q", "Quote it.", {"instruction_id_list": ["format:quote_unquote"], "kwargs": [{}]}, "ifeval")
    try:
        assert asyncio.run(pool(["!!!", 'He said "go" and went.'], record)) == [0.0, 1.0]
        metrics = pool.take_metrics()
    finally:
        pool.close()
    assert metrics["verifier/ifeval/runtime_error"] == 1
    assert metrics["verifier/ifeval/samples"] == 2
    assert metrics["verifier/ifeval/all_followed"] == 1


BLOCK_NETWORK = """
import socket, os

def _refuse(*args, **kwargs):
    with open(os.environ["CONNECT_LOG"], "a") as log:
        log.write(repr(args[1:2]) + "\\n")
    raise OSError("network blocked by the test")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.getaddrinfo = _refuse
socket.create_connection = _refuse
"""

SCORE_OFFLINE = """
import json, sys
from megatron_rlvr.config import FileData, VerifierConfig
from megatron_rlvr.data import load_data
from megatron_rlvr.rewards.instruction.checkers import score
from megatron_rlvr.rewards.registry import Verifiers

spec = FileData(path=sys.argv[1]); spec.fill_keys()
cfg = VerifierConfig(kind="ifeval", timeout_s=5.0)
rows = [json.loads(line) for line in open(sys.argv[1])]
records = load_data(spec, cfg).records
task = {"grading": "binary", "loose": False}
by_record = [score(row["response"], {**task, "ground_truth": r.answer, "prompt": row["prompt"]}) for row, r in zip(rows, records)]
# and every response against one record in one sandbox batch (its supervisor is a fresh interpreter)
verifiers = Verifiers(cfg, {})
one_batch = verifiers.verify([row["response"] for row in rows], records[1])
verifiers.close()
print(json.dumps([by_record, [reward for reward, _ in one_batch]]))
"""


def _offline(tmp_path: Path, code: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """Runs code in a fresh interpreter (and the sandbox processes it starts) where every
    connection attempt is logged and refused, with no NLTK data directory of the user's."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    log = tmp_path / "connects.log"
    log.write_text("")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "CONNECT_LOG": str(log),
        "HOME": str(tmp_path),  # no ~/nltk_data
        "NLTK_DATA": str(tmp_path / "no-nltk-data"),
    }
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=240)
    return done, log.read_text()


def test_the_verifier_needs_no_network_and_downloads_nothing(tmp_path):
    """With every connection refused (and logged), the published examples load and score as
    in the first test, here and in the sandbox, and no connection is attempted; the library imported on its own, in the
    same harness, does try to download its NLTK data: the harness sees attempts."""
    done, attempts = _offline(tmp_path, SCORE_OFFLINE, str(EXAMPLES))
    assert done.returncode == 0, done.stderr[-2000:]
    assert attempts == ""
    by_record, one_batch = json.loads(done.stdout)
    assert by_record == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert one_batch == [0.0, 1.0, 0.0, 0.0, 0.0]  # lowercase: only the second response
    bare, attempts = _offline(tmp_path, "import if_verifiable.ifbench.instructions_registry")
    assert bare.returncode == 0, bare.stderr[-2000:]
    assert attempts.count("\n") >= 1, bare.stderr[-2000:]


def test_the_nltk_data_is_punkt_s_english_model_and_nltk_reads_it(tmp_path):
    """The sentence model written for NLTK splits as the packaged model does (abbreviations,
    initials, times), and the stop words are NLTK's English list."""
    import nltk
    import punkt

    from megatron_rlvr.rewards.instruction.nltk_data import write_nltk_data

    root = write_nltk_data(tmp_path / "nltk_data")
    text = textwrap.dedent(
        """\
        Dr. Smith met Mr. J. R. Jones at 5 p.m. on Jan. 3. They talked about the U.S. economy.
        Was it fun? It was! The meeting ended at 6 p.m. and everyone went home."""
    )
    nltk.data.path.insert(0, str(root))
    try:
        from nltk.tokenize.punkt import PunktTokenizer

        ours = PunktTokenizer("english").tokenize(text)
        assert ours == punkt.sent_tokenize(text, "english")
        assert len(ours) == 5
        stop = nltk.corpus.reader.WordListCorpusReader(str(root / "corpora" / "stopwords"), ["english"]).words()
        assert len(stop) == 179 and {"the", "and", "ourselves"} <= set(stop)
    finally:
        nltk.data.path.remove(str(root))


def test_language_detection_is_seeded():
    """langdetect draws at random on every call unless seeded: once the checkers are loaded,
    the same mixed-language text gets the same languages and probabilities every time."""
    import langdetect

    from megatron_rlvr.rewards.instruction.checkers import registry

    registry()
    text = "Ok merci, ciao amigo, das ist gut"
    assert len({str(langdetect.detect_langs(text)) for _ in range(6)}) == 1


def test_one_supervisor_serves_every_batch_and_a_dead_one_is_replaced():
    """The checkers are loaded once: batches reuse the supervisor; a child past its time limit
    is a timeout and the supervisor goes on; a supervisor that died is replaced at the next batch."""
    from megatron_rlvr.rewards.instruction.verifier import IFEvalVerifier

    record = PromptRecord("q", "Write.", {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}, "ifeval")
    verifier = IFEvalVerifier(grading="binary", loose=False, timeout_s=5.0, memory_mb=1024)
    try:
        assert verifier.verify_batch(["no commas here", "a, b"], record) == [
            (1.0, "all_followed"),
            (0.0, "not_followed"),
        ]
        assert verifier._supervisor is not None
        first = verifier._supervisor.proc.pid
        assert verifier.verify_batch(["fine"], record) == [(1.0, "all_followed")]
        assert verifier._supervisor.proc.pid == first
        verifier.settings["wall_s"] = 0.0  # every child is past its deadline at once
        assert verifier.verify_batch(["fine"], record) == [(0.0, "timeout")]
        verifier.settings["wall_s"] = 5.0
        assert verifier.verify_batch(["fine"], record) == [(1.0, "all_followed")]
        assert verifier._supervisor.proc.pid == first
        os.killpg(first, 9)
        verifier._supervisor.proc.wait()
        assert verifier.verify_batch(["fine", "a, b"], record) == [(0.0, "sandbox_error"), (0.0, "sandbox_error")]
        assert verifier.verify_batch(["fine"], record) == [(1.0, "all_followed")]
        assert verifier._supervisor.proc.pid != first
        workdir = verifier._supervisor.workdir  # its NLTK data is made in there too
        assert any(name.startswith("rlvr-nltk-") for name in os.listdir(workdir))
    finally:
        verifier.close()
    assert verifier._supervisor is None
    assert not os.path.exists(workdir)
