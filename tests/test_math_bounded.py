"""The math verifier ends every verification within its timeout whatever the response: every
pattern it reads text with stays linear on long adversarial input, 100 kB responses are read
in time, and a response that would hang is killed with its worker, scored 0 as `timeout` and
counted, while the run's verifier pool finishes the step."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

from megatron_rlvr.config import Config
from megatron_rlvr.data.records import PromptRecord
from megatron_rlvr.launch.placement import InProcess
from megatron_rlvr.launch.verifiers import VerifierPool
from megatron_rlvr.rewards.math.verifier import MathVerifier

REPO = Path(__file__).resolve().parents[1]
# sympy must evaluate sin of a number with ~10^8 digits: minutes, unless its worker is killed
RUNAWAY = "So the answer is $\\boxed{\\sin(e^{e^{e^{3}}})}$."
# exponential in the answer-sentence pattern this verifier once used: 1.6x per added letter
WORD_BAIT = "The answer is 5 (" + "so" * 40


def test_every_pattern_stays_linear_on_long_adversarial_text():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        out = subprocess.run(
            [sys.executable, str(REPO / "tests" / "math_pattern_fuzz.py")],
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
    except subprocess.TimeoutExpired as err:  # an exponential pattern: the last name printed
        last = (err.stdout or b"").decode().strip().splitlines()[-1:]
        raise AssertionError(f"the fuzz did not finish within 400 s; stuck in {last}") from None
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all linear" in out.stdout


def test_100_kb_adversarial_responses_are_read_within_the_timeout():
    responses = [
        "(" * 100_000,
        "\\boxed{" + "{" * 100_000,
        "\\boxed{[" + " " * 100_000 + "1}",
        "The answer is 5 (" + "so" * 50_000,
        "$" + "\\frac{1}{" * 10_000,
        "1" * 100_000,
        "a_" * 50_000 + "\\boxed{1} and \\boxed{2}",
        "the answer is " + " " * 100_000 + "x",
        "\\(" * 50_000,
        "x" * 100_000 + " so the answer is \\boxed{12}",
    ]
    with MathVerifier(timeout_s=30.0, num_workers=1) as verifier:
        verdicts = verifier.verify_batch(responses, ["12"] * len(responses))
    assert "timeout" not in [reason for _, reason in verdicts], verdicts
    assert [reward for reward, _ in verdicts] == [0.0] * 9 + [1.0]


def _step(pool: VerifierPool, group: list[str], record: PromptRecord, bound_s: float = 120.0) -> list[float]:
    """One scoring step, waited on for at most bound_s: a verifier that hangs fails the test
    here with TimeoutError (the thread is a daemon: a hung step cannot hold the test process)."""
    result: dict[str, list[float]] = {}
    thread = threading.Thread(target=lambda: result.update(rewards=asyncio.run(pool(group, record))), daemon=True)
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        raise TimeoutError(f"the verifier pool's step did not finish within {bound_s} s")
    return result["rewards"]


def test_a_hanging_response_is_scored_timeout_and_the_pool_finishes_its_step():
    cfg = Config.model_validate({"verifier": {"timeout_s": 1.0, "num_workers": 1}})
    pool = VerifierPool(cfg, InProcess(cfg))
    record = PromptRecord("m", "sin(e^e^e^3) to 40 digits", "0", "math")
    hung = False
    try:
        assert _step(pool, ["\\boxed{0}", RUNAWAY, WORD_BAIT, "The answer is $0$."], record) == [1.0, 0.0, 0.0, 1.0]
        metrics = pool.take_metrics()
        assert metrics["verifier/timeout"] == 1 and metrics["verifier/math/timeout"] == 1, metrics
        # the worker that was killed has been replaced: the next group is scored as usual
        assert _step(pool, ["\\boxed{0}"], record) == [1.0]
    except TimeoutError:
        hung = True  # the hung step still holds the pool: leave it
        raise
    finally:
        if not hung:
            pool.close()


def test_a_worker_computing_a_runaway_verdict_ends_when_its_parent_is_killed(tmp_path):
    """Its deadline is the parent's to enforce: a worker left behind by a killed run (or test)
    must not compute forever (one was found at 67% of a core an hour after its parent died)."""
    import psutil

    script = (
        "import sys, threading\n"
        "from megatron_rlvr.rewards.math.verifier import MathVerifier\n"
        "v = MathVerifier(timeout_s=600.0, num_workers=1)\n"
        f"threading.Thread(target=v.verify, args=({RUNAWAY!r}, '0'), daemon=True).start()\n"
        "print('started', flush=True)\n"
        "threading.Event().wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        workers: list = []
        for _ in range(600):  # the worker: started, then handed the runaway pair
            workers = [
                c for c in psutil.Process(parent.pid).children() if "rewards.math.workers" in " ".join(c.cmdline())
            ]
            if workers and workers[0].cpu_times().user > 1.0:
                break
            threading.Event().wait(0.1)
        assert workers, "no sandbox worker started"
        parent.kill()
        parent.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"orphaned workers still running: {[p.pid for p in alive]}"
    finally:
        parent.kill()
        for child in psutil.Process().children(recursive=True):
            if "rewards.math.workers" in " ".join(child.cmdline()):
                child.kill()
