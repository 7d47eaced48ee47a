"""The learner facade: one object per rank that owns the Megatron model, optimizer and LR
schedule, and offers the calls the RL loop needs: logprobs, train step, HF export,
checkpoints. Every method is collective: all learner ranks call it with the same batch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlvr.algo.corrections import StepCorrection, step_correction
from megatron_rlvr.algo.from_config import rollout_correction_of
from megatron_rlvr.config import ConfigError, HFModel, ResolvedConfig
from megatron_rlvr.learner import model as model_lib
from megatron_rlvr.learner.batch import (
    MicroBatch,
    TrainBatch,
    budget_micro_batches,
    micro_batches,
    minibatch_indices,
    pad_rows,
)
from megatron_rlvr.learner.checkpoint import load_model
from megatron_rlvr.learner.forward import (
    forward_logprobs,
    reduce_metrics,
    step_normalizer,
    train_minibatch,
)
from megatron_rlvr.learner.parallel import device as rank_device
from megatron_rlvr.learner.routing_replay import RecordRouting, ReplayRouting, RoutingReplay, WatchRouting
from megatron_rlvr.run_dir import learner_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)


def _fingerprint(batch: TrainBatch) -> tuple:
    return tuple(batch.input_ids.shape), int(batch.input_ids.sum()), int(batch.response_mask.sum())


class Learner:
    def __init__(self, cfg: ResolvedConfig, hf_dir: str | Path):
        """Builds this rank's model shard from the HF checkpoint, wraps it in Megatron DDP and
        creates the (distributed) optimizer. Parallel state must be initialised first."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.cfg = cfg
        if cfg.trainer.pack_sequences and not model_lib.have_transformer_engine():
            raise ConfigError(["trainer.pack_sequences = true: transformer_engine does not import here (THD needs it)"])
        dtype = DTYPES[cfg.trainer.dtype]
        hf_config = model_lib.read_hf_config(hf_dir)
        # the engine's routing, when captured, is also measured against ours in every mode
        routers_driven = cfg.algo.routing_replay != "none" or bool(cfg.rollout.return_routed_experts)
        self.bridge = model_lib.make_bridge(
            hf_config,
            device=cfg.parallel.device,
            dtype=dtype,
            routing_replay=routers_driven,
            recompute=cfg.trainer.recompute_activations,
            expert_bias_update_rate=cfg.trainer.expert_bias_update_rate,
        )
        RouterReplay.clear_global_router_replay_instances()  # a process-global list: ours only
        modules = model_lib.build_model_chunks(self.bridge)
        if isinstance(cfg.model, HFModel) and cfg.model.mcore_checkpoint:
            load_model(modules, learner_checkpoint(cfg.model.mcore_checkpoint, "model.mcore_checkpoint"))
        else:
            model_lib.load_hf_weights(modules, self.bridge, hf_dir)
        tcfg = self.bridge.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.trainer.distributed_optimizer,
        )
        self.chunks = [DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=m) for m in modules]
        self.optimizer = self._make_optimizer(dtype)
        self.scheduler = self._make_scheduler()
        tcfg.finalize_model_grads_func = finalize_model_grads
        t = cfg.trainer
        if t.max_tokens_per_microbatch or t.max_tokens_per_logprob_microbatch:
            if tcfg.moe_token_dispatcher_type == "allgather":  # it needs equal shapes on every rank
                raise ValueError("token-budget micro-batches need the alltoall MoE token dispatcher")
            # budgeted micro-batches differ in shape: each pipeline send carries its shape first
            tcfg.variable_seq_lengths = cfg.parallel.pp > 1
        self._said_over_budget = False
        tcfg.grad_scale_func = self.optimizer.scale_loss
        self.step = 0
        self.replay = None
        if routers_driven:
            self.replay = RoutingReplay(
                modules,
                num_layers=hf_config.num_hidden_layers,
                top_k=hf_config.num_experts_per_tok,
                sequence_parallel=tcfg.sequence_parallel,
                recompute=cfg.trainer.recompute_activations,
            )
        self._recorded_batch: tuple | None = None  # which batch R2's recorded routing belongs to
        self._engine_agreement: dict[str, float] = {}

    def close(self) -> None:
        """Lets the model, its optimizer and the process groups they hold go with this learner.
        Megatron's DDP hooks every parameter's gradient-accumulation node with a closure that
        holds the DDP; the DDP keeps those nodes, and so do the optimizer's views of the
        parameters, which the model's config reaches through grad_scale_func: cycles through C++
        that Python's collector cannot see. Left alone, each run in a process that goes on (local
        mode, compare-replay, the benchmarks) kept its model and its gloo groups, whose polling
        threads took a growing share of the learner's core."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        tcfg = self.bridge.config
        tcfg.grad_scale_func = tcfg.finalize_model_grads_func = None
        for chunk in self.chunks:
            chunk.grad_accs.clear()
        RouterReplay.clear_global_router_replay_instances()

    # ------------------------------------------------------------------ setup
    def _make_optimizer(self, dtype: torch.dtype):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.cfg.trainer
        config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=0.9,
            adam_beta2=t.adam_beta2,
            adam_eps=1e-8,
            clip_grad=t.grad_clip,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=t.distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(config, self.chunks)
        # Without TE/apex Megatron falls back to torch's Adam, which on CPU tensors steps one
        # parameter at a time unless told otherwise (the demo's cold start: 28 ms of a 350 ms
        # step on 2 cores, 17 ms with foreach)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(inner.optimizer, torch.optim.Adam):  # AdamW included
                for group in inner.optimizer.param_groups:
                    group["foreach"] = True
        return optimizer

    def _make_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t = self.cfg.trainer
        per_step = self.cfg.algo.num_minibatches * self.cfg.algo.epochs  # optimizer steps a trainer step
        total = max(t.steps * per_step, 1)
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if t.warmup_steps else t.lr,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps * per_step,
            lr_decay_steps=total,
            lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The unwrapped GPTModel chunks of this rank."""
        return [c.module for c in self.chunks]

    # ------------------------------------------------------------------ layout helpers
    def _micro_batches(
        self, batch: TrainBatch, rows_per_rank: list[list[torch.Tensor]], max_tokens: int | None
    ) -> list[MicroBatch]:
        """This DP rank's micro-batches of its row groups (`rows_per_rank[rank]`, indices of
        the batch, one group per mini-batch): micro_batch_size rows of each group, or, under a
        token budget, the rank's rows of all groups cut by the budget."""
        from megatron.core import parallel_state as mpu

        multiple = self._seq_multiple
        batch = batch.padded_to(multiple)
        rank = mpu.get_data_parallel_rank()
        if max_tokens is None:
            return [
                mb
                for rows in rows_per_rank[rank]
                for mb in micro_batches(batch, rows, self.cfg.trainer.micro_batch_size)
            ]
        flat = [torch.cat(groups) for groups in rows_per_rank]
        micro, over = budget_micro_batches(batch, flat, rank, max_tokens, multiple, self.cfg.trainer.pack_sequences)
        if over and not self._said_over_budget:
            self._said_over_budget = True
            log.warning(
                "samples longer than the token budget of %d tokens (here the longest needs %d) each get a "
                "micro-batch of their own (said once)",
                max_tokens,
                max(over),
            )
        return micro

    @property
    def _seq_multiple(self) -> int:
        """What every micro-batch's width is a multiple of: sequence parallel splits positions over TP."""
        return self.cfg.parallel.tp if self.bridge.config.sequence_parallel else 1

    def _rows_per_rank(self, batch_size: int, num_minibatches: int) -> list[list[torch.Tensor]]:
        """Every DP rank's sample indices per mini-batch."""
        from megatron.core import parallel_state as mpu

        dp = mpu.get_data_parallel_world_size()
        return [minibatch_indices(batch_size, num_minibatches, dp, rank) for rank in range(dp)]

    # ------------------------------------------------------------------ calls
    def _routing_hooks(self, batch: TrainBatch, phase: str):
        """Micro-batch hooks for the configured replay mode: R2 records in the old-logprob
        pass and replays in training; R3 replays the engine's routing in both; without replay
        the old-logprob pass only watches the routing (against the engine's, if captured)."""
        mode = self.cfg.algo.routing_replay
        if mode == "none":
            return WatchRouting(self.replay) if self.replay is not None and phase == "old_logprobs" else None
        assert self.replay is not None, "built whenever algo.routing_replay is r2 or r3"
        if mode == "r3":
            self._check_routed_experts(batch)
            return ReplayRouting(self.replay, "engine")
        if phase == "old_logprobs":
            self.replay.recorded.clear()
            self._recorded_batch = _fingerprint(batch)
            return RecordRouting(self.replay)
        if self._recorded_batch != _fingerprint(batch):
            raise RuntimeError(
                "algo.routing_replay = r2 replays the routing recorded while computing "
                "this batch's old logprobs: call compute_logprobs(batch) first"
            )
        return ReplayRouting(self.replay, "recorded")

    def _probe_hooks(self, batch: TrainBatch):
        """Outside the old-logprob pass (the parity probe): the engine's routing replayed when
        the batch carries it, so a comparison with the engine is free of routing flips."""
        if batch.routed_experts is None:
            return None
        assert self.replay is not None, "routers are driven whenever the engines capture routing"
        self._check_routed_experts(batch)
        return ReplayRouting(self.replay, "engine")

    def _check_routed_experts(self, batch: TrainBatch) -> None:
        hf = self.bridge.hf_config
        expected = (batch.size, batch.input_ids.shape[1], hf.num_hidden_layers, hf.num_experts_per_tok)
        if batch.routed_experts is None:
            raise ValueError(
                "algo.routing_replay = r3 needs the engine's routed experts for every "
                "sample (batch.routed_experts is missing; is the engine capturing them?)"
            )
        if tuple(batch.routed_experts.shape) != expected:
            raise ValueError(
                f"batch.routed_experts shaped {tuple(batch.routed_experts.shape)}, "
                f"expected [batch, tokens, layers, top_k] = {list(expected)}"
            )

    def compute_logprobs(self, batch: TrainBatch, *, old_logprob_pass: bool = True) -> torch.Tensor:
        """Per-token logprobs [B, T] of the batch under the current weights, on every rank.
        The old-logprob pass (default) partitions the batch like the train step and, under R2,
        records the routing, under R3 replays the engine's. Otherwise (e.g. the parity probe)
        the batch may have any size and the routing is the engine's when the batch carries
        it, else the model's own."""
        from megatron.core import parallel_state as mpu

        for chunk in self.chunks:
            chunk.eval()
        rows = batch.size
        num_minibatches = self.cfg.algo.num_minibatches
        if not old_logprob_pass:
            num_minibatches = 1
            batch = pad_rows(batch, mpu.get_data_parallel_world_size())
        t = self.cfg.trainer
        per_rank = self._rows_per_rank(batch.size, num_minibatches)
        micro = self._micro_batches(batch, per_rank, t.max_tokens_per_logprob_microbatch or t.max_tokens_per_microbatch)
        hooks = self._routing_hooks(batch, "old_logprobs") if old_logprob_pass else self._probe_hooks(batch)
        per_micro = forward_logprobs(self.chunks, micro, self.cfg.rollout.temperature, hooks)
        if self.replay is not None and old_logprob_pass:
            self.replay.clear()
            self.replay.stop_measuring()
            self._engine_agreement = self.replay.take_agreement("routing_agreement_engine")
        elif self.replay is not None and hooks is not None:
            self.replay.clear()
        mine = torch.cat(per_rank[mpu.get_data_parallel_rank()])
        width = batch.padded_to(self._seq_multiple).input_ids.shape[1]
        device = rank_device()  # the collectives' tensors live on the groups' device
        ours = torch.zeros(len(mine), width, device=device)
        if per_micro is not None:  # the last pipeline stage: each row at its place among this rank's
            position = torch.empty(batch.size, dtype=torch.long)
            position[mine] = torch.arange(len(mine))
            for mb, logprobs in zip(micro, per_micro):
                ours[position[mb.rows], : logprobs.shape[1]] = logprobs[: len(mb.rows)]
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            last = mpu.get_pipeline_model_parallel_last_rank()
            dist.broadcast(ours, src=last, group=mpu.get_pipeline_model_parallel_group())
        gathered = [torch.empty_like(ours) for _ in per_rank]
        dist.all_gather(gathered, ours, group=mpu.get_data_parallel_group())
        full = torch.zeros(batch.size, width)
        for groups, part in zip(per_rank, gathered):
            full[torch.cat(groups)] = part.cpu()
        return full[:rows, : batch.input_ids.shape[1]]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """algo.epochs passes over the batch, each num_minibatches optimizer steps in the same
        order (needs advantages and old_logprobs). Returns each metric's mean over every
        optimizer step; with several passes also the last pass's own means as last_epoch/*
        (how far the later passes drifted from the old policy)."""
        for chunk in self.chunks:
            chunk.train()
        per_mini = self.cfg.algo.num_minibatches
        per_rank = self._rows_per_rank(batch.size, per_mini)
        correction = self._step_correction(batch)
        if correction is not None:
            batch = replace(batch, kept=correction.keep)
        full_minis = [
            batch.select(torch.arange(k * batch.size // per_mini, (k + 1) * batch.size // per_mini))
            for k in range(per_mini)
        ]
        history: list[dict[str, float]] = []
        hooks = self._routing_hooks(batch, "train")
        passes = [(k, full) for _ in range(self.cfg.algo.epochs) for k, full in enumerate(full_minis)]
        for k, full in passes:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            micro = self._micro_batches(
                batch, [[groups[k]] for groups in per_rank], self.cfg.trainer.max_tokens_per_microbatch
            )
            outputs = train_minibatch(
                self.chunks,
                micro,
                self.cfg.algo,
                normalizer=step_normalizer(full, self.cfg.algo.agg),
                sum_norm_divisor=float(self.cfg.rollout.max_new_tokens),
                temperature=self.cfg.rollout.temperature,
                correction_batch_mean=correction.batch_mean if correction is not None else None,
                hooks=hooks,
            )
            if self.replay is not None:
                self.replay.clear()
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            metrics = reduce_metrics(outputs)
            metrics.update(
                grad_norm=float(grad_norm or 0.0), update_skipped=float(not ok), lr=self.optimizer.param_groups[0]["lr"]
            )
            history.append(metrics)
        self.step += 1
        metrics = mean_metrics(history)
        if self.cfg.algo.epochs > 1:
            metrics.update({f"last_epoch/{k}": v for k, v in mean_metrics(history[-per_mini:]).items()})
        if self.replay is not None:
            self.replay.stop_measuring()
            metrics.update(self.replay.take_agreement("routing_agreement"))
            metrics.update(self._engine_agreement)
        return metrics

    def _step_correction(self, batch: TrainBatch) -> StepCorrection | None:
        """The rollout correction's step-wide part (batch normalisation's mean, the rejected
        tokens), decided over the whole batch on every rank alike, so no cut changes it."""
        correction = rollout_correction_of(self.cfg.algo)
        if batch.rollout_logprobs is None or batch.old_logprobs is None or batch.advantages is None:
            return None
        return step_correction(
            batch.old_logprobs, batch.rollout_logprobs, batch.advantages, batch.response_mask, correction
        )

    def sft_step(self, micro: list[TrainBatch], *, train: bool = True) -> dict[str, float]:
        """One supervised step over a step's micro-batches (the same list on every rank):
        the mean negative logprob of masked tokens, then an optimizer step unless train is
        false (a held-out loss). See learner/sft.py."""
        from megatron.core import parallel_state as mpu

        from megatron_rlvr.learner import sft

        dp = mpu.get_data_parallel_world_size()
        local = sft.local_micro_batches(
            micro,
            dp=dp,
            dp_rank=mpu.get_data_parallel_rank(),
            tp_multiple=self.cfg.parallel.tp if self.bridge.config.sequence_parallel else 1,
            same_shape=mpu.get_pipeline_model_parallel_world_size() > 1,
        )
        normalizer = max(float(sum(mb.response_mask.sum() for mb in micro)), 1.0)
        for chunk in self.chunks:
            chunk.train(train)
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = sft.sft_schedule(self.chunks, local, normalizer=normalizer, dp=dp, forward_only=not train)
        metrics = sft.reduce_loss(outputs)
        if train:
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.step += 1
            metrics.update(grad_norm=float(grad_norm or 0.0), update_skipped=float(not ok))
            metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full model as HF-named tensors (collective; see model.export_hf_weights)."""
        return model_lib.export_hf_weights(self.modules, self.bridge)


def mean_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over optimizer steps."""
    return {key: sum(h[key] for h in history) / len(history) for key in history[0]}
