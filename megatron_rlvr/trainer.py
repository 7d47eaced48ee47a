"""The RL loop. Each step: a batch of useful groups → old logprobs (R2 records, R3 replays
the engines' routing) → group advantages → N mini-batch updates → weight sync (+ parity
probe) → metrics → checkpoint.

Synchronous runs generate the next batch after the weight sync. With buffer.async_rollout
the next batch is generated while this one trains, by a policy at most one version older
(the buffer drops anything staler than buffer.max_staleness). With rollout.updates =
in_flight the engines never stop: weight syncs land in the middle of sequences, and each
step's metrics say how stale its tokens were and how busy the engines and the learner were."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from megatron_rlvr.algo.from_config import advantage_options
from megatron_rlvr.batching import groups_to_batch, response_length_metrics
from megatron_rlvr.config import ResolvedConfig
from megatron_rlvr.loop_metrics import staleness_metrics
from megatron_rlvr.reporting import RunReport
from megatron_rlvr.rollout.sampler import NothingToLearn
from megatron_rlvr.run import Run, open_run
from megatron_rlvr.stopping import StopRequested, StopSignals


@dataclass
class Outcome:
    history: list[dict] = field(default_factory=list)  # every step's metrics, in order
    message: str = ""  # why the run ended early, when it did without an error
    teardown_failures: list[str] = field(default_factory=list)  # components that did not stop cleanly


def train(cfg: ResolvedConfig, stop: StopSignals | None = None) -> Outcome:
    """Runs the loop until trainer.steps, a stop request (StopRequested, after a checkpoint of
    the last finished step unless the request was urgent) or a data set with nothing left to
    teach (the outcome says so, after a checkpoint)."""
    stop = stop or StopSignals()
    outcome = Outcome()
    steps, overlap = cfg.trainer.steps, cfg.buffer.async_rollout or cfg.rollout.updates == "in_flight"
    advantage = advantage_options(cfg.algo)
    with open_run(cfg, stop) as run:
        first = (run.resume() if cfg.trainer.resume else 0) + 1
        report = RunReport.for_run(cfg, first_step=first, once=run.data_stats)
        try:
            if first == 1:
                report.log_eval(0, run.evaluate(0))  # the initial policy, before any rollout
            if first <= steps and run.pending is None:  # a resumed async run may have its next batch
                run.request_batch(run.version)
            lap = time.perf_counter()  # the end of the previous step's metrics line
            for step in range(first, steps + 1):
                started = time.perf_counter()
                groups = run.next_batch()
                stop.check(f"before step {step}")
                if overlap and step < steps:
                    run.request_batch(run.version + 1)
                batch = groups_to_batch(
                    groups,
                    advantage=advantage,
                    ema=run.ema_baselines,
                    pad_id=run.tokenizer.pad_token_id or 0,
                    routing=run.routing_shape,
                    slots=cfg.algo.num_minibatches * cfg.parallel.dp,
                    # a token budget cuts rows itself: no padding rows to whole micro-batches
                    micro_batch_size=None if cfg.trainer.max_tokens_per_microbatch else cfg.trainer.micro_batch_size,
                )
                staleness = staleness_metrics(batch, run.version)
                learner_started = time.perf_counter()
                run.sleep_engines()  # colocated: the engines make room for the learner
                bypass = cfg.algo.rollout_correction.bypass_mode  # the engine's logprobs are the old ones
                batch.old_logprobs = batch.rollout_logprobs if bypass else run.learners.compute_logprobs(batch)
                learner_metrics = run.learners.train_step(batch)
                learner_s = time.perf_counter() - learner_started
                run.version += 1
                run.trained_step = step
                run.trained_groups += len(groups)
                sync_metrics = run.sync_weights(defer_parity=True)
                metrics = step_metrics(
                    step, run, learner_metrics, sync_metrics, time.perf_counter() - started, len(groups)
                )
                now = time.perf_counter()
                wall_s, lap = now - lap, now
                metrics.update(staleness | overlap_metrics(run, metrics["rollout/tokens"], learner_s, wall_s))
                metrics.update(response_length_metrics(groups))
                metrics.update(run.evaluate(step))  # {} unless evaluation is due
                report.log(metrics)
                outcome.history.append(metrics)
                run.finish_step(
                    step,
                    save=step == steps or (cfg.trainer.save_interval > 0 and step % cfg.trainer.save_interval == 0),
                )
                run.raise_parity_failure()  # a failed probe ends the run with this step saved
                stop.check(f"after step {step}")
                if not overlap and step < steps:  # after the metrics and the checkpoint it belongs to
                    run.request_batch(run.version)
        except NothingToLearn as err:
            outcome.message = f"{err}. {run.save_last()}"
        except StopRequested as err:
            err.args = (f"{err}; {run.save_last() if not stop.urgent else 'second signal: no checkpoint'}",)
            raise
        finally:
            report.close()
    outcome.teardown_failures = run.teardown_failures
    return outcome


def overlap_metrics(run: Run, tokens: int, learner_s: float, wall_s: float) -> dict:
    """How well generation and training overlapped over the step's wall time (from the end of
    the previous metrics line): tokens generated per second, and the engines' and the
    learner's busy shares."""

    async def engines_busy() -> float:
        return run.manager.busy_fraction(wall_s)

    return {
        "loop/tokens_per_s": tokens / wall_s,
        "loop/engine_busy_fraction": run.rollout.run(engines_busy()),
        "loop/learner_busy_fraction": learner_s / wall_s,
    }


def step_metrics(step: int, run: Run, learner: dict, sync: dict, seconds: float, batch_groups: int) -> dict:
    """The step's metrics line. A step trained from the buffer's surplus alone scored no new
    sample: it has no reward/mean (a gap in the curves), and reward/samples says 0."""

    async def rollout_side() -> tuple:
        return (run.sampler.take_rewards(), run.sampler.step_stats(), await run.buffer.stats(), dict(run.manager.stats))

    (rewards, tokens), sampling, buffer, engines = run.rollout.run(rollout_side())
    return {
        "step": step,
        **({"reward/mean": statistics.fmean(rewards)} if rewards else {}),
        "reward/samples": len(rewards),
        "rollout/tokens": tokens,
        "buffer/batch_groups": batch_groups,
        "buffer/used": run.trained_groups,
        "buffer/kept_groups": buffer["kept"],
        "buffer/dropped_zero_std": buffer["dropped_zero_std"],
        **{f"buffer/{k}": v for k, v in buffer.items() if k not in ("kept", "dropped_zero_std")},
        **sampling,
        "rollout/moved_groups": engines.get("moved", 0),
        "rollout/engines_serving": run.manager.serving,
        "rollout/engine_kind": run.cfg.rollout.engine.type,
        **run.verifiers.take_metrics(),
        "time/step_s": seconds,
        "policy_version": run.version,
        **{f"train/{k}": v for k, v in learner.items()},
        **sync,
    }
