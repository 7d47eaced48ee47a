"""A run's teardown tries every step whatever failed before it, logs each failure with the
component it came from, and a failure to stop after a finished training makes the exit code
non-zero."""

from __future__ import annotations

import logging

from megatron_rlvr.cli import train_exit_code
from megatron_rlvr.config import load_config
from megatron_rlvr.run import Run, _teardown
from megatron_rlvr.stopping import StopSignals
from megatron_rlvr.trainer import Outcome


class Component:
    """Stands in for a started component; records how it was asked to stop."""

    def __init__(self, fails: bool = False):
        self.fails, self.calls = fails, []

    def close(self, graceful: bool = True) -> None:
        self.calls.append(("close", graceful))
        if self.fails:
            raise ConnectionError("actor died")

    def stop(self, graceful: bool = True) -> None:
        self.calls.append(("stop", graceful))
        if self.fails:
            raise TimeoutError("server did not exit")


def started_run() -> Run:
    return Run(load_config(None), model_dir=None, tokenizer=None, stop=StopSignals())


def test_every_step_is_tried_and_each_failure_names_its_component(caplog):
    run = started_run()
    run.learners, run.verifiers, run.engines = Component(fails=True), Component(fails=True), Component()
    with caplog.at_level(logging.ERROR, logger="megatron_rlvr.run"):
        _teardown(run)
    assert run.learners.calls == [("close", True)] and run.verifiers.calls == [("close", True)]
    assert run.engines.calls == [("stop", True)]  # after two failures before it
    assert not run.rollout.thread.is_alive()
    assert run.teardown_failures == ["closing the learner ranks", "closing the verifier workers"]
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        "teardown: closing the learner ranks failed: ConnectionError: actor died",
        "teardown: closing the verifier workers failed: ConnectionError: actor died",
    ]


def test_a_clean_teardown_reports_nothing_and_an_urgent_one_asks_nobody_to_wait():
    run = started_run()
    run.learners, run.engines = Component(), Component()
    run.stop.request()
    run.stop.request()  # a second request: urgent
    _teardown(run)
    assert run.teardown_failures == []
    assert run.learners.calls == [("close", False)] and run.engines.calls == [("stop", False)]


def test_a_finished_run_that_failed_to_stop_exits_non_zero(capsys):
    assert train_exit_code(Outcome(history=[{"step": 1}])) == 0
    assert train_exit_code(Outcome(history=[{"step": 1}], teardown_failures=["stopping the engines"])) == 1
    assert "finished, but stopping failed for: stopping the engines" in capsys.readouterr().err
