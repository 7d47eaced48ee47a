"""Routing replay (R2, R3) on Megatron-Core's RouterReplay, fed per micro-batch.

RouterReplay keeps, per router, ONE target index tensor for the next forward, in the router's
local token order: [s_local · b, top_k], sequence-major, where s_local is this rank's
sequence-parallel chunk. So targets are set before every micro-batch's forward, from:
  R2: what the old-logprob pass recorded for each of the micro-batch's rows, kept per row
      (positions gathered over the SP ranks) so that the train step may cut the rank's rows
      into other micro-batches (token budgets differ between the two passes), or
  R3: the engine's routing, a host tensor [B, T, num_hidden_layers, top_k], mapped here to
      this rank's tokens (SP chunk) and this stage's MoE layers (dense layers skipped).
A packed micro-batch (trainer.pack_sequences) is one sequence: the router's token order is the
packed order (b = 1; under SP, this rank's chunk of it), so per-position values are packed
(learner/packing.py) before they are cut to the local order, and R2's recording is split back
into rows.
With activation recompute, the recomputed forward inside backward pops targets in micro-batch
order (REPLAY_BACKWARD); a hook on each micro-batch's output switches to it when that
micro-batch's backward starts.

Router forward hooks also measure, per layer, how often the natural top-k agrees with the
target (the replayed routing, or the engine's when a natural forward is only watched), and
how often the routing the router actually used does (the `_used` metric: 1.0 under replay).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.learner import ModelChunk
from megatron_rlvr.learner.batch import MicroBatch
from megatron_rlvr.learner.packing import PackedRows, pack, unpack_rows
from megatron_rlvr.learner.parallel import device as rank_device


def _moe_routers(modules: list[ModelChunk]) -> list[tuple[int, Any]]:
    """(global layer index, router) for this stage's MoE layers, in construction order."""
    routers = []
    for module in modules:
        for layer in module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                routers.append((layer.layer_number - 1, router))
    return routers


def local_token_order(per_position: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, ...] per-position values → this rank's router token order [s_local · b, ...]."""
    seq_major = per_position.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        chunk = seq_major.shape[0] // tp_size
        seq_major = seq_major[tp_rank * chunk : (tp_rank + 1) * chunk]
    return seq_major.reshape(-1, *seq_major.shape[2:])


def replay_valid_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose routing counts [b, s]: real tokens except the last one (engines do not
    route the last sampled token; padding is never seen by counted positions)."""
    positions = torch.arange(response_mask.shape[1]).expand_as(response_mask)
    last = torch.where(response_mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)
    return positions < last.unsqueeze(1)


def natural_routing_map(router, hidden: torch.Tensor) -> torch.Tensor:
    """The experts this router would choose for `hidden` on its own, [tokens, experts] bool, by
    Megatron's own rule for the family: score function, pre-softmax, expert score bias and
    group-limited top-k (DeepSeek-V3's n_group/topk_group) all count."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = router.config
    logits = router.gating(hidden).view(-1, config.num_moe_experts)
    _, routing_map = topk_routing_with_score_function(
        logits,
        router.topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=router.score_function,
        expert_bias=getattr(router, "expert_bias", None),
        fused=False,
        router_replay=None,
    )
    return routing_map.bool()


class RoutingReplay:
    """This rank's routers and their RouterReplay instances, driven per micro-batch."""

    def __init__(
        self, modules: list[ModelChunk], *, num_layers: int, top_k: int, sequence_parallel: bool, recompute: bool
    ):
        from megatron.core import parallel_state as mpu

        self.routers = _moe_routers(modules)
        if any(router.router_replay is None for _, router in self.routers):
            raise RuntimeError("routing replay needs moe_enable_routing_replay=True in the model")
        self.num_layers, self.top_k = num_layers, top_k
        self.sequence_parallel, self.recompute = sequence_parallel, recompute
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.recorded: dict[int, torch.Tensor] = {}  # batch row → [positions, local MoE layers, top_k]
        experts = max((router.config.num_moe_experts for _, router in self.routers), default=0)
        self._recorded_dtype = torch.uint8 if experts <= 256 else torch.int16 if experts <= 32768 else torch.int32
        self._agree = torch.zeros(num_layers, dtype=torch.float64)
        self._count = torch.zeros(num_layers, dtype=torch.float64)
        self._used = torch.zeros(num_layers, dtype=torch.float64)
        self._valid: torch.Tensor | None = None
        self._hooks = [router.register_forward_hook(self._measure(layer)) for layer, router in self.routers]

    # ------------------------------------------------------------------ actions
    def _set_action(self, action) -> None:
        for _, router in self.routers:
            router.router_replay.set_router_replay_action(action)

    def clear(self) -> None:
        """Forget targets (and the backward FIFO) and return the routers to natural routing."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def record(self) -> None:
        """Before a micro-batch forward of the old-logprob pass (R2)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set_action(RouterReplayAction.RECORD)

    def watch(
        self, routed_experts: torch.Tensor | None, response_mask: torch.Tensor, packed: PackedRows | None = None
    ) -> None:
        """Before a forward that routes naturally: measure that routing against the engine's
        (set as targets, which no replay action reads), when the micro-batch carries it."""
        self._valid = None
        if routed_experts is not None:
            for (_, router), target in zip(self.routers, self.engine_targets(routed_experts, packed)):
                router.router_replay.set_target_indices(target.long())
            self._valid = self.local_valid(response_mask, packed)

    def keep_recorded(self, rows: torch.Tensor, width: int, packed: PackedRows | None = None) -> None:
        """After that forward: keep what each local router chose, per row of the micro-batch
        (`rows`, `width` positions, or the rows of the pack), over all positions (gathered from
        the SP ranks)."""
        from megatron.core import parallel_state as mpu

        if not self.routers or not len(rows):
            return
        per_layer = []
        for _, router in self.routers:
            chosen = router.router_replay.get_recorded_indices().detach()
            if self.sequence_parallel and self.tp_size > 1:
                parts = [torch.empty_like(chosen) for _ in range(self.tp_size)]
                dist.all_gather(parts, chosen, group=mpu.get_tensor_model_parallel_group())
                chosen = torch.cat(parts)  # the SP chunks, in position order
            per_layer.append(chosen.cpu().to(self._recorded_dtype).view(-1, self.top_k))
        if packed is not None:  # [total, local layers, k] in packed order
            per_row = unpack_rows(torch.stack(per_layer, dim=1), packed)
        else:
            by_position = torch.stack(per_layer, dim=1).view(width, -1, len(per_layer), self.top_k)
            per_row = list(by_position.transpose(0, 1))  # [b][s, local layers, k]
        for j, row in enumerate(rows.tolist()):
            self.recorded[row] = per_row[j].clone()

    def recorded_targets(
        self, rows: torch.Tensor, size: int, width: int, packed: PackedRows | None = None
    ) -> list[torch.Tensor]:
        """R2's recorded routing for a micro-batch of `size` rows (`rows` of the batch, then
        fillers) and `width` positions, per local MoE layer [s_local · b, k]. Positions past
        what was recorded are padding (they reach no counted token): any distinct experts do."""
        filler = torch.arange(self.top_k, dtype=self._recorded_dtype)
        per_position = filler.expand(size, width, len(self.routers), self.top_k).clone()
        for j, row in enumerate(rows.tolist()):
            kept = self.recorded[row][:width]
            per_position[j, : kept.shape[0]] = kept
        local = self._local(per_position, packed)
        return [local[:, i] for i in range(len(self.routers))]

    def replay(self, targets: list[torch.Tensor], valid: torch.Tensor) -> None:
        """Before a micro-batch forward: force each local router to `targets` (one tensor per
        local MoE layer, in local token order)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._valid = valid
        for (_, router), target in zip(self.routers, targets):
            router.router_replay.set_target_indices(target.long())
        self._set_action(RouterReplayAction.REPLAY_FORWARD)

    def replay_backward_on(self, output: torch.Tensor) -> None:
        """With activation recompute, switch to REPLAY_BACKWARD when this micro-batch's backward
        begins (gradients reach its output before any recomputed layer)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.recompute and output.requires_grad:
            output.register_hook(lambda grad: self._set_action(RouterReplayAction.REPLAY_BACKWARD))

    # ------------------------------------------------------------------ data mapping
    def _local(self, per_position: torch.Tensor, packed: PackedRows | None) -> torch.Tensor:
        """[b, s, ...] per-position values of a micro-batch → this rank's router token order."""
        if packed is not None:
            per_position = pack(per_position, packed)
        return local_token_order(per_position, self.tp_rank, self.tp_size, self.sequence_parallel)

    def engine_targets(self, routed_experts: torch.Tensor, packed: PackedRows | None = None) -> list[torch.Tensor]:
        """Engine routing of a micro-batch [b, s, num_hidden_layers, k] → per local MoE layer
        [s_local · b, k]."""
        if routed_experts.shape[2:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"routed experts shaped {tuple(routed_experts.shape)}: the model has "
                f"{self.num_layers} layers with top-{self.top_k}"
            )
        local = self._local(routed_experts, packed)
        return [local[:, layer] for layer, _ in self.routers]

    def local_valid(self, response_mask: torch.Tensor, packed: PackedRows | None = None) -> torch.Tensor:
        return self._local(replay_valid_mask(response_mask), packed)

    # ------------------------------------------------------------------ agreement
    def _measure(self, layer: int):
        """Router forward hook: does the natural top-k of this forward agree with the replayed
        target? (Only replayed forwards set `_valid`; recomputations are skipped.)"""

        def hook(router, args, output):
            if self._valid is None or (self.recompute and torch.is_grad_enabled()):
                return
            with torch.no_grad():
                natural = natural_routing_map(router, args[0])
                target = router.router_replay.target_topk_idx.to(natural.device).long()
                valid = self._valid.to(natural.device)
                used = output[1].bool()  # the routing map [tokens, experts] the layer dispatched with
                target_map = torch.zeros_like(used).scatter_(1, target, True)
                self._agree[layer] += ((natural == target_map).all(dim=-1) & valid).sum().item()
                self._used[layer] += ((used == target_map).all(dim=-1) & valid).sum().item()
                self._count[layer] += self._valid.sum().item()

        return hook

    def take_agreement(self, prefix: str) -> dict[str, float]:
        """Agreement of natural vs target routing since the last call, summed over all ranks:
        overall and per layer (only MoE layers that saw tokens); `{prefix}_used`: the routing
        actually used vs the target, overall."""
        totals = torch.stack([self._agree, self._count, self._used]).to(rank_device())
        dist.all_reduce(totals)  # on the default group's device: NCCL takes no CPU tensor
        totals = totals.cpu()
        for tally in (self._agree, self._count, self._used):
            tally.zero_()
        agree, count, used = totals
        if count.sum() == 0:
            return {}
        out = {prefix: float(agree.sum() / count.sum()), f"{prefix}_used": float(used.sum() / count.sum())}
        for layer in range(self.num_layers):
            if count[layer] > 0:
                out[f"{prefix}/layer{layer}"] = float(agree[layer] / count[layer])
        return out

    def stop_measuring(self) -> None:
        self._valid = None


class WatchRouting:
    """Micro-batch hooks of an old-logprob pass without replay: the routing stays natural and is
    measured against the engine's, when the batch carries it."""

    def __init__(self, replay: RoutingReplay):
        self.replay = replay

    def before_forward(self, mb: MicroBatch) -> None:
        self.replay.watch(mb.data.routed_experts, mb.data.response_mask, mb.packed)

    def after_forward(self, mb: MicroBatch, output: torch.Tensor) -> None:
        pass


class RecordRouting(WatchRouting):
    """Micro-batch hooks of the R2 old-logprob pass: record every router's choice."""

    def before_forward(self, mb: MicroBatch) -> None:
        super().before_forward(mb)
        self.replay.record()

    def after_forward(self, mb: MicroBatch, output: torch.Tensor) -> None:
        self.replay.keep_recorded(mb.rows, mb.data.input_ids.shape[1], mb.packed)


class ReplayRouting:
    """Micro-batch hooks that force the routers: to what R2 recorded for the micro-batch's rows,
    or (R3) to the engine's routing carried by the micro-batch."""

    def __init__(self, replay: RoutingReplay, source: str):
        self.replay, self.source = replay, source

    def before_forward(self, mb: MicroBatch) -> None:
        data = mb.data
        if self.source == "recorded":
            targets = self.replay.recorded_targets(mb.rows, data.size, data.input_ids.shape[1], mb.packed)
        else:
            assert data.routed_experts is not None, "the learner checks R3 batches for routed experts"
            targets = self.replay.engine_targets(data.routed_experts, mb.packed)
        self.replay.replay(targets, self.replay.local_valid(data.response_mask, mb.packed))

    def after_forward(self, mb: MicroBatch, output: torch.Tensor) -> None:
        self.replay.replay_backward_on(output)
