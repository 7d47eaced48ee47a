"""`megatron-rlvr sft CONFIG`: supervised fine-tuning on the RL learner (any layout, placed as
`train` places its ranks), as the cold start of an RL run.

Each step trains on sft.batch_tokens tokens of conversations, grouped first-fit-decreasing
into micro-batches of at most sft.micro_batch_tokens (or packed into rows of that many,
sft.pack_sequences); the held-out conversations' loss is
logged every sft.eval_interval steps. At the end the model is exported as an HF folder (the
RL config's model.path) and, with sft.pass_at_1, scored on eval.sets by an engine and the
verifiers, through the evaluation `train` runs at its step 0. Metrics go where train's go
(metrics.jsonl, TensorBoard, the progress bar). Checkpoints are train's (run_dir.save: step
folders under trainer.output_dir/checkpoint, each complete before `latest` names it,
trainer.save_interval, trainer.keep_checkpoints); an output folder that holds a run is refused
unless trainer.resume continues it, and a stop request saves the last finished step."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from megatron_rlvr import run_dir
from megatron_rlvr.config import ResolvedConfig, load_config
from megatron_rlvr.errors import UserError
from megatron_rlvr.reporting import RunReport
from megatron_rlvr.stopping import StopRequested, StopSignals

log = logging.getLogger(__name__)
OLD_CHECKPOINT = "sft_checkpoint"  # an older version's one folder, saved over in place


class SftError(UserError):
    """An SFT run that cannot start, said in one line."""


def export_dir(cfg: ResolvedConfig) -> Path:
    assert cfg.sft is not None
    return Path(cfg.sft.export_dir or Path(cfg.trainer.output_dir) / "hf")


def run_sft(config_path: str, overrides: list[str], stop: StopSignals) -> tuple[dict, Path]:
    """Trains, exports and evaluates; returns the last metrics logged and the HF folder."""
    from megatron_rlvr.launch.placement import Role, call_all, close_all, placement_for
    from megatron_rlvr.run import prepare_model
    from megatron_rlvr.sft import data as sft_data
    from megatron_rlvr.sft.rank import SftRank

    cfg = load_config(config_path, overrides)
    sft, t = cfg.sft, cfg.trainer
    if sft is None:
        raise SftError(f"{config_path}: no sft section (the sft command trains on sft.data)")
    if t.warmup_steps >= t.steps:  # Megatron's scheduler asserts it, without a word
        raise SftError(f"trainer.warmup_steps = {t.warmup_steps}: must be < trainer.steps = {t.steps}")
    out = Path(t.output_dir)
    run_dir.check_output_dir(cfg)  # a new run never writes over an old one
    if t.resume and (out / OLD_CHECKPOINT).is_dir():
        raise run_dir.CheckpointError(
            f"{out / OLD_CHECKPOINT} is a checkpoint of an older version (saved in place), which this version "
            "does not resume: start afresh in another trainer.output_dir (its learner part still converts: "
            f"megatron-rlvr convert mcore-to-hf --ckpt {out / OLD_CHECKPOINT})"
        )
    out.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(cfg)
    renderer = sft_data.ConversationRenderer(tokenizer, cfg.data)
    examples = [renderer.example(c) for c in sft_data.load_conversations(sft, t.seed)]
    kept = [e for e in examples if len(e) <= sft.max_tokens]
    heldout, train = kept[len(kept) - sft.heldout_examples :], kept[: len(kept) - sft.heldout_examples]
    if not train:
        raise SftError(f"sft: nothing to train on ({len(kept)} conversations, sft.heldout_examples = {len(heldout)})")
    pad = tokenizer.pad_token_id or 0
    batches = sft_data.step_batches(train, sft.batch_tokens, t.steps, t.seed)

    def micro_batches(examples: list[sft_data.Example]) -> list:
        return sft_data.pack_micro_batches(
            examples, sft.micro_batch_tokens, pad, sft.pack_sequences, row_tokens=sft.max_tokens
        )

    heldout_micro = micro_batches(heldout) if heldout else []
    once = {
        "data/sft_examples": len(train),
        "data/sft_heldout": len(heldout),
        "data/too_long": len(examples) - len(kept),
    }

    placement = placement_for(cfg)
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    root = out / run_dir.CHECKPOINT
    with tempfile.TemporaryDirectory(prefix="rlvr-sft-") as temp, placement.session(str(Path(temp) / "ray")):
        ranks = [
            placement.place(Role.LEARNER_RANK, SftRank, cfg, str(model_dir), rank, world, index=rank)
            for rank in range(world)
        ]

        def on_all(method: str, *args):
            return call_all(ranks, method, *args, stop=stop, urgent_only=True)[0]

        try:
            master = ranks[0].call("rendezvous_address")
            call_all(ranks, "setup", master, stop=stop, urgent_only=False)
            resumed = run_dir.resume(root, lambda p: on_all("load", str(p)), "sft") if t.resume else None
            saved = resumed[1]["step"] if resumed else 0  # the step of the checkpoint on disk
            if resumed:
                log.info("resumed from %s at step %d", resumed[0], saved)
            first = saved + 1

            def save(step: int) -> None:
                nonlocal saved
                state = {"command": "sft", "step": step}
                run_dir.save(root, step, state, lambda p: on_all("save", str(p)), t.keep_checkpoints)
                saved = step

            report = RunReport.for_run(cfg, first_step=first, once=once)
            last: dict = {}
            try:
                if first == 1 and heldout_micro:
                    report.log_eval(0, {"heldout/sft_loss": on_all("sft_step", heldout_micro, False)["sft_loss"]})
                for step in range(first, t.steps + 1):
                    started = time.perf_counter()
                    micro = micro_batches(batches[step - 1])
                    metrics = on_all("sft_step", placement.share(micro), True)
                    seconds = time.perf_counter() - started
                    last = {
                        "step": step,
                        **{f"train/{k}": v for k, v in metrics.items()},
                        "train/micro_batches": len(micro),
                        "train/padding": 1.0
                        - sum(len(e) for e in batches[step - 1]) / sum(mb.input_ids.numel() for mb in micro),
                        "time/step_s": seconds,
                    }
                    due = step == t.steps or (sft.eval_interval and step % sft.eval_interval == 0)
                    if due and heldout_micro:
                        last["heldout/sft_loss"] = on_all("sft_step", heldout_micro, False)["sft_loss"]
                    report.log(last)
                    if step == t.steps or (t.save_interval and step % t.save_interval == 0):
                        save(step)
                    stop.check(f"after SFT step {step}")
                on_all("export", str(export_dir(cfg)))
            except StopRequested as err:
                finished = int(last.get("step", saved))
                if not stop.urgent and finished > saved:
                    save(finished)
                where = f"checkpoint of step {saved} in {root}" if saved else "no checkpoint"
                err.args = (f"{err}; {where} (continue with trainer.resume=true)",)
                raise
            finally:
                report.close()
        finally:
            close_all(ranks, grace_s=0.0 if stop.urgent else 20.0)
    log.info("exported the fine-tuned model to %s", export_dir(cfg))
    if sft.pass_at_1 and cfg.eval.sets:
        scores = evaluate_export(config_path, overrides, cfg, stop)
        _append_eval(out / "metrics.jsonl", t.steps, scores)
        last.update(scores)
    return last, export_dir(cfg)


def evaluate_export(config_path: str, overrides: list[str], cfg: ResolvedConfig, stop: StopSignals) -> dict:
    """eval.sets scored on the exported model by the same evaluation `train` runs at step 0:
    a one-rank local run of the exported model (engine, verifiers), nothing trained."""
    from megatron_rlvr.run import open_run

    # the export is the model now: overrides of the trained model's shape (model.num_experts=8)
    # describe it and are not fields of an HF model section
    kept = [o for o in overrides if o.split("=", 1)[0].strip().split(".")[0] != "model"]
    run_cfg = load_config(
        config_path,
        [
            *kept,
            "model.type=hf",
            f"model.path={export_dir(cfg)}",
            "launch.mode=local",
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.ep=1",
            "parallel.etp=1",
            "parallel.dp=1",
            "rollout.num_engines=1",
            "eval.at_start=true",
            f"trainer.output_dir={Path(cfg.trainer.output_dir) / 'pass_at_1'}",
        ],
    )
    with open_run(run_cfg, stop) as run:
        return run.evaluate(0)


def _append_eval(metrics_path: Path, step: int, scores: dict) -> None:
    """The final pass@1 as one more line of the SFT run's metrics.jsonl (at its last step)."""
    import json

    with open(metrics_path, "a") as f:
        f.write(json.dumps({"step": step, **scores}) + "\n")


def summary(metrics: dict) -> str:
    """One line for the terminal: the final held-out loss and eval scores."""
    shown = {k: v for k, v in metrics.items() if k.startswith(("eval/", "heldout/")) and "time" not in k}
    return ", ".join(f"{k} {v:.3f}" for k, v in shown.items()) or "no held-out set"
