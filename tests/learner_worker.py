"""One learner rank for the multi-process tests (launched by tests/distributed.py).

    learner_worker.py SCENARIO HF_DIR [CKPT_DIR] [dotted.config=overrides ...]

Scenarios: parity (logprobs vs HF, one train step, export), sft, ckpt-save, ckpt-load, descent,
replay-r2, replay-r3, replay-r3-perturbed, short-batch, budget, packed (GPU only), epochs-xN.
Writes this rank's JSON result to $RESULT.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from tiny_families import hf_forward_with_routing, hf_model

from megatron_rlvr.config import load_config
from megatron_rlvr.learner.batch import TrainBatch, row_extents
from megatron_rlvr.learner.checkpoint import load_checkpoint, save_checkpoint
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.model import mtp_tensor_names
from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel

BASE = ["trainer.micro_batch_size=2", "rollout.max_new_tokens=8", "algo.num_minibatches=2"]


def fixed_batch(vocab: int, batch_size: int = 16, length: int = 12) -> TrainBatch:
    """The same batch on every rank and in every layout: prompts of 4 tokens, responses of
    varying length, right padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, length), generator=gen)
    mask = torch.zeros(batch_size, length)
    for b in range(batch_size):
        mask[b, 4 : 6 + b % 6] = 1
    return TrainBatch(ids, mask)


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Each token's logprob under the model given the tokens before it (0 for the first)."""
    logp = torch.log_softmax(model(ids).logits.float(), -1)
    return torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


def hf_logprobs(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(hf_model(hf_dir), ids)


def with_rl_fields(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    gen = torch.Generator().manual_seed(1)
    batch.old_logprobs = logprobs + 0.02 * torch.randn(logprobs.shape, generator=gen)
    batch.rollout_logprobs = logprobs + 0.05 * torch.randn(logprobs.shape, generator=gen)
    batch.advantages = torch.randn(batch.size, generator=gen)
    return batch


def parity(learner: Learner, hf_dir: str) -> dict:
    from safetensors.torch import load_file

    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    logprobs = learner.compute_logprobs(batch)
    reference = hf_logprobs(hf_dir, batch.input_ids)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    mtp = mtp_tensor_names(set(original), learner.bridge.hf_config)  # skipped on purpose
    original = {name: tensor for name, tensor in original.items() if name not in mtp}
    exported = {name: tensor.to("cpu", copy=True) for name, tensor in learner.export_hf()}
    metrics = learner.train_step(with_rl_fields(batch, logprobs))
    after = learner.compute_logprobs(batch)
    moved = {name: tensor.cpu() for name, tensor in learner.export_hf()}
    return {
        "logprob_max_diff_vs_hf": float((logprobs - reference)[:, 1:].abs().max()),
        "metrics": metrics,
        "logprobs_after_step": after.tolist(),
        "exported_names_match": sorted(exported) == sorted(original),
        "export_bitwise_equal": all(torch.equal(exported[n], original[n]) for n in original if n in exported),
        "export_changed_after_training": any(not torch.equal(moved[n], original[n]) for n in original),
        "mtp_tensors_skipped": len(mtp),
        "expert_bias_moved": any(
            not torch.equal(moved[n], original[n]) for n in original if n.endswith("e_score_correction_bias")
        ),
    }


def entropy_check() -> dict:
    """Logprobs and entropy from vocab-sharded logits (this rank's slice), computed a few
    tokens at a time, against the closed form on the full logits: values and gradients."""
    from megatron.core import parallel_state as mpu

    from megatron_rlvr.learner.logits import logprobs_and_entropy
    from megatron_rlvr.learner.parallel import device

    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(3)
    full = (torch.randn(2, 5, 24, generator=gen) * 3).to(device())
    ids = torch.randint(0, 24, (2, 5), generator=gen).to(device())
    weights = torch.randn(2, 2, 5, generator=gen).to(device())
    whole = full.clone().requires_grad_()
    logp = torch.log_softmax(whole[:, :-1] / 0.7, -1)
    pad = torch.nn.functional.pad
    ref_lp = pad(logp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    ref_h = pad(-(logp.exp() * logp).sum(-1), (1, 0))
    ((ref_lp * weights[0]).sum() + (ref_h * weights[1]).sum()).backward()
    result = {}
    for rows in (3, None):  # chunks that split sequences, and the default (one chunk)
        shard = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
        lp, h = logprobs_and_entropy(shard, ids, temperature=0.7, chunk_rows=rows)
        ((lp * weights[0]).sum() + (h * weights[1]).sum()).backward()
        result[str(rows)] = {
            "logprob_diff": float((lp - ref_lp).abs().max()),
            "value_diff": float((h - ref_h).abs().max()),
            "grad_diff": float((shard.grad - whole.grad.chunk(tp, dim=-1)[rank]).abs().max()),
        }
    return result


def save_as_if_on_gpu() -> None:
    """Makes save_checkpoint write what a CUDA rank writes: the device, and CUDA (Philox)
    generator states, 16 bytes each, that no CPU generator accepts."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_rlvr.learner import checkpoint

    philox = torch.arange(16, dtype=torch.uint8)
    checkpoint._device = lambda: "cuda"
    torch.cuda.get_rng_state = lambda *args, **kwargs: philox.clone()
    tracker = get_cuda_rng_tracker()
    tracker.get_states = lambda: {name: philox.clone() for name in tracker.states_}


def te_key(name: str, module, bridge) -> str:
    """The checkpoint key a transformer-engine-spec model gives a parameter, from mbridge's
    TE parameter names (what its HF mapping is written against) and Megatron's own rules: a
    dense layer's pre-MLP norm fused into linear_fc1 (an MoE layer's kept apart), layers
    stacked on one axis unless some are dense and some MoE (then keyed by their number),
    grouped-GEMM experts under SequentialMLP's key."""
    import re

    from megatron_rlvr.learner.model import canonical_name

    te_name = canonical_name(name, module, bridge)
    layer = re.match(r"decoder\.layers\.\d+\.", name)
    if layer and ".pre_mlp_layernorm." in name and f"{layer.group(0)}mlp.router.weight" not in module.state_dict():
        te_name = te_name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
    assert bridge._weight_name_mapping_mcore_to_hf(te_name), te_name  # a name mbridge knows
    key = te_name
    if not isinstance(bridge.config.moe_layer_freq, list):
        key = re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", te_name)
    return re.sub(r"mlp\.experts\.(linear_fc[12])\.weight\d+$", r"mlp.experts.experts.\1.weight", key)


def checkpoint_specs(learner: Learner, out: str) -> dict:
    """Model checkpoints keyed as the transformer-engine spec keys them: what save_model
    writes on CPU, and a TE-keyed checkpoint (with TE-only extra state) loading on CPU."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_rlvr.learner.checkpoint import load_model, save_model
    from megatron_rlvr.learner.model import _params

    module, bridge = learner.modules[0], learner.bridge
    expected = {te_key(name, module, bridge) for name, _ in _params(module)}
    save_model(learner.modules, f"{out}/ours")
    written = set(dist_checkpointing.load_tensors_metadata(f"{out}/ours"))
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.25)
    te_state = module.sharded_state_dict()  # the local spec's own keys, rewritten to TE's
    for name, value in list(te_state.items()):
        if name.endswith("._extra_state"):
            continue
        value.key = te_key(name, module, bridge)
        if value.key.endswith("layernorm.weight"):  # a TENorm's FP8 metadata, which a local model lacks
            stacked = value.key.startswith("decoder.layers.") and not value.key.split(".")[2].isdigit()
            te_state[name.replace(".weight", "._extra_state")] = ShardedObject(
                value.key.replace(".weight", "._extra_state"),
                None,
                (learner.bridge.config.num_layers,) if stacked else (1,),
                (int(name.split(".")[2]),) if stacked else (0,),
                replica_id=0,
            )
    import os

    os.makedirs(f"{out}/te")
    dist_checkpointing.save({"model": te_state}, f"{out}/te")
    legacy = {name: p.detach().clone() for name, p in module.named_parameters()}
    os.makedirs(f"{out}/legacy")  # the local spec's keys, as checkpoints were written before
    dist_checkpointing.save({"model": module.sharded_state_dict()}, f"{out}/legacy")
    loaded = {}
    for kind in ("te", "legacy"):
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(before[name])
        load_model(learner.modules, f"{out}/{kind}")
        loaded[kind] = all(torch.equal(p, legacy[name]) for name, p in module.named_parameters())
    return {"written": sorted(written), "expected": sorted(expected), "loaded": loaded}


def descent(learner: Learner) -> dict:
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    batch.old_logprobs = learner.compute_logprobs(batch)
    batch.advantages = torch.linspace(-1.0, 1.0, batch.size)
    steps = [learner.train_step(batch) for _ in range(6)]
    return {"losses": [m["policy_loss"] for m in steps], "entropies": [m["entropy"] for m in steps]}


def epochs_scenario(learner: Learner, hf_dir: str, calls: int) -> dict:
    """`calls` train steps on one fixed batch (its old logprobs taken once, before any); the
    logprobs after, and every step's metrics."""
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    batch = with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids))
    batch.old_logprobs = learner.compute_logprobs(batch)
    steps = [learner.train_step(batch) for _ in range(calls)]
    return {"logprobs": learner.compute_logprobs(batch, old_logprob_pass=False).tolist(), "metrics": steps}


class UsedRouting:
    """Test probe: for every router call, does the routing used equal the replay target?
    Recomputed forwards inside backward (grad enabled under activation recompute) take their
    targets from Megatron's FIFO, not the latest target: they are checked end to end instead
    (same loss and gradients as without recompute)."""

    def __init__(self, learner: Learner):
        self.mismatched = self.checked = 0
        self.recompute = learner.cfg.trainer.recompute_activations
        replay = learner.replay
        for _, router in replay.routers:
            router.register_forward_hook(self._check)

    def _check(self, router, args, output):
        target = router.router_replay.target_topk_idx
        action = router.router_replay.router_replay_action
        if target is None or action is None or action.value == "record":
            return
        if self.recompute and torch.is_grad_enabled():
            return
        used = output[1].float().topk(router.topk, dim=-1).indices.sort(-1).values
        self.checked += used.shape[0]
        self.mismatched += int((used != target.to(used.device).long().sort(-1).values).any(-1).sum())


def hf_routing(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """HF transformers' own top-k routing [B, T, layers, k] for these tokens (dense layers 0)."""
    return hf_forward_with_routing(hf_model(hf_dir), ids)[1]


def with_engine_routing(batch: TrainBatch, routing: torch.Tensor, num_experts: int) -> TrainBatch:
    """Round-trips HF's routing through SGLang's wire format, as an engine would send it."""
    from megatron_rlvr.learner.routing_replay import replay_valid_mask
    from megatron_rlvr.rollout.routed_experts import decode_routed_experts, encode_routed_experts, pack_routed_experts

    lengths = (replay_valid_mask(batch.response_mask).sum(1) + 1).tolist()
    layers, k = routing.shape[2], routing.shape[3]
    decoded = [
        decode_routed_experts(
            encode_routed_experts(routing[b, : n - 1].numpy()),
            num_layers=layers,
            top_k=k,
            num_experts=num_experts,
            sample=str(b),
        )
        for b, n in enumerate(lengths)
    ]
    batch.routed_experts = pack_routed_experts(
        decoded,
        lengths,
        batch.input_ids.shape[1],
        num_layers=layers,
        top_k=k,
        sample_ids=[str(b) for b in range(batch.size)],
    )
    return batch


def perturb_routers(learner: Learner, scale: float) -> None:
    """The same noise per global layer in every layout."""
    with torch.no_grad():
        for layer, router in learner.replay.routers:
            gen = torch.Generator().manual_seed(7 + layer)
            noise = torch.randn(router.weight.shape, generator=gen)  # on the CPU, for every device
            router.weight.add_(scale * noise.to(router.weight.device))


def router_weights(learner: Learner) -> list[torch.Tensor]:
    return [router.weight.detach().clone() for _, router in learner.replay.routers]


def replay_r2(learner: Learner, hf_dir: str) -> dict:
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    probe = UsedRouting(learner)
    batch = with_rl_fields(batch, learner.compute_logprobs(batch))
    perturb_routers(learner, 1.0)  # the natural routing now differs from what was recorded
    before = router_weights(learner)
    metrics = learner.train_step(batch)
    after = router_weights(learner)
    return {
        "checked": probe.checked,
        "mismatched": probe.mismatched,
        "metrics": metrics,
        "router_weights_moved": all(not torch.equal(a, b) for a, b in zip(before, after)),
    }


def replay_r3(learner: Learner, hf_dir: str, perturb: bool) -> dict:
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    batch = with_engine_routing(batch, hf_routing(hf_dir, batch.input_ids), learner.bridge.hf_config.num_experts)
    if perturb:
        perturb_routers(learner, 1.0)
    probe = UsedRouting(learner)
    logprobs = learner.compute_logprobs(batch)
    valid = torch.zeros_like(logprobs, dtype=torch.bool)
    valid[:, 1:] = batch.response_mask[:, 1:] > 0
    diff = (logprobs - hf_logprobs(hf_dir, batch.input_ids))[valid].abs().max()
    metrics = learner.train_step(with_rl_fields(batch, logprobs))
    return {
        "checked": probe.checked,
        "mismatched": probe.mismatched,
        "metrics": metrics,
        "logprob_max_diff_vs_hf": float(diff),
    }


def replay_errors(learner: Learner) -> dict:
    """The messages a user gets for replay misuse."""
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    errors = {}
    for name, call in (
        ("train_before_logprobs", lambda: learner.train_step(with_rl_fields(batch, torch.zeros(16, 12)))),
    ):
        try:
            call()
        except (RuntimeError, ValueError) as err:
            errors[name] = str(err)
    return errors


def sync_scenario(learner: Learner, urls: list[str], corrupt: bool) -> dict:
    """Train a step, push the weights to the engines, compare every engine tensor bitwise."""
    import asyncio

    import httpx
    import torch.distributed as dist

    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.weight_sync import syncer as syncer_module
    from megatron_rlvr.weight_sync.learner_sync import sync_weights

    source = dist.get_rank() == 0
    loop = asyncio.new_event_loop() if source else None
    syncer = None
    if source:
        syncer = syncer_module.WeightSyncer([EngineClient(u) for u in urls], learner.cfg.weight_sync)
        loop.run_until_complete(syncer.connect())
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    learner.train_step(with_rl_fields(batch, learner.compute_logprobs(batch)))
    exported = {name: tensor.to("cpu", copy=True) for name, tensor in learner.export_hf()}
    start_version = syncer.version if source else 0
    result: dict = {"metrics": sync_weights(learner, start_version + 1, syncer=syncer, loop=loop)}
    if not source:
        return result
    mismatched = [
        name
        for name, tensor in exported.items()
        for url in urls
        if not torch.equal(
            torch.tensor(
                httpx.post(
                    f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.shape[0]}, timeout=60
                ).json()
            ),
            tensor,
        )
    ]
    result.update(
        checked=len(exported) * len(urls),
        mismatched=mismatched,
        versions=loop.run_until_complete(syncer.engine_versions()),
    )
    if corrupt:  # world 1 only: the error paths of the next sync
        result.update(integrity_checks(learner, syncer, syncer_module, loop, urls, start_version + 1))
    return result


def integrity_checks(learner, syncer, syncer_module, loop, urls, version) -> dict:
    import httpx

    from megatron_rlvr.weight_sync.learner_sync import sync_weights

    out = {}
    real_broadcast = syncer_module.broadcast

    def flip_a_byte(group, tensor, root=0):
        corrupted = tensor.clone()
        corrupted[len(corrupted) // 2] ^= 0xFF
        real_broadcast(group, corrupted, root)

    syncer_module.broadcast = flip_a_byte
    try:
        sync_weights(learner, version + 1, syncer=syncer, loop=loop)
    except syncer_module.WeightSyncError as err:
        out["corrupted_error"] = str(err)
    finally:
        syncer_module.broadcast = real_broadcast
    out["version_after_corruption"] = loop.run_until_complete(syncer.engine_versions())
    out["retry_metrics"] = sync_weights(learner, version + 1, syncer=syncer, loop=loop)
    httpx.post(f"{urls[0]}/update_weight_version", json={"new_version": str(version + 5)}, timeout=30)
    try:
        sync_weights(learner, version + 2, syncer=syncer, loop=loop)
    except syncer_module.WeightSyncError as err:
        out["skipped_error"] = str(err)
    return out


def short_batch(learner: Learner, hf_dir: str) -> dict:
    """A short batch (5 samples, as at the generation bound) laid out with padding rows for
    2-sample micro-batches, against the same 5 samples in one micro-batch: the padding rows
    must change nothing (lr ~ 0 keeps the weights equal between the two steps)."""
    from megatron_rlvr.batching import spread_over_slots

    batch = with_rl_fields(
        fixed_batch(learner.bridge.hf_config.vocab_size, batch_size=5),
        hf_logprobs(hf_dir, fixed_batch(learner.bridge.hf_config.vocab_size, batch_size=5).input_ids),
    )
    padded = spread_over_slots(batch, slots=1, micro_batch_size=2)
    learner.cfg.trainer.micro_batch_size = 2
    with_padding = learner.train_step(padded)
    learner.cfg.trainer.micro_batch_size = 8
    plain = learner.train_step(batch)
    return {
        "rows": padded.size,
        "padding_masked": float(padded.response_mask[5:].sum()),
        "with_padding": with_padding,
        "plain": plain,
    }


def long_tailed_batch(vocab: int) -> TrainBatch:
    """16 samples of 24 positions: prompts of 4 tokens, responses mostly short with a long tail
    (two rows fill or nearly fill the row), in mixed order so that budgets cut them unevenly."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (16, 24), generator=gen)
    mask = torch.zeros(16, 24)
    for b, n in enumerate([2, 3, 1, 20, 4, 2, 3, 6, 2, 19, 3, 2, 5, 2, 12, 3]):
        mask[b, 4 : 4 + n] = 1
    return TrainBatch(ids, mask)


BUDGETED = ["trainer.max_tokens_per_microbatch=20", "trainer.max_tokens_per_logprob_microbatch=36"]
# step-wide parts of the rollout correction, which no cut may change: weights normalised to a
# batch mean of 1, and token rejection (about a quarter of the tokens) out of the normaliser
STEP_WIDE_CORRECTION = [
    "algo.rollout_correction.rollout_is_batch_normalize=true",
    "algo.rollout_correction.rollout_rs=token_k2",
    "algo.rollout_correction.rollout_rs_threshold=0.002",
]


def budget_equality(hf_dir: str, overrides: list[str]) -> dict:
    """Token-budget micro-batches (uneven cuts, different in the two passes, the two longest
    rows over the training budget) against one padded micro-batch per rank and mini-batch,
    without replay, with R2 (routers perturbed between the passes) and with R3, with the
    correction's step-wide parts on: logprobs, entropy, loss, grad norm, and this rank's
    gradient buffers after the step."""
    overrides = [*overrides, *STEP_WIDE_CORRECTION]
    return learner_equality(hf_dir, overrides, ("padded", ["trainer.micro_batch_size=8"]), ("budget", BUDGETED))


def packed_equality(hf_dir: str, overrides: list[str]) -> dict:
    """Packed micro-batches (trainer.pack_sequences: THD on transformer-engine, GPU only)
    against the budgeted ones they pack, as budget_equality compares those with padding."""
    return learner_equality(
        hf_dir, overrides, ("budget", BUDGETED), ("packed", [*BUDGETED, "trainer.pack_sequences=true"])
    )


def learner_equality(
    hf_dir: str, overrides: list[str], reference: tuple[str, list[str]], candidate: tuple[str, list[str]]
) -> dict:
    """Two learners that must agree (`reference`, `candidate`: name and config overrides) on the
    long-tailed batch, in each replay mode: logprobs, metrics, gradient buffers."""
    out: dict = {}
    for mode in ("none", "r2", "r3"):
        seen: dict[str, dict] = {}
        for name, extra in (reference, candidate):
            learner = Learner(load_config(None, [*BASE, *overrides, f"algo.routing_replay={mode}", *extra]), hf_dir)
            batch = long_tailed_batch(learner.bridge.hf_config.vocab_size)
            if mode == "r3":
                batch = with_engine_routing(
                    batch, hf_routing(hf_dir, batch.input_ids), learner.bridge.hf_config.num_experts
                )
            probe = UsedRouting(learner) if mode != "none" else None
            logprobs = learner.compute_logprobs(batch)
            if mode == "r2":
                perturb_routers(learner, 1.0)
            metrics = learner.train_step(with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids)))
            grads = torch.cat([p.main_grad.flatten().cpu() for m in learner.modules for p in m.parameters()])
            seen[name] = {"logprobs": logprobs, "metrics": metrics, "grads": grads, "probe": probe}
            learner.close()  # its model and groups go now, not at the end of the process
        ref, cand = seen[reference[0]], seen[candidate[0]]
        counted = torch.zeros_like(batch.response_mask, dtype=torch.bool)
        counted[:, 1:] = batch.response_mask[:, 1:] > 0
        out[mode] = {
            "logprob_diff": float(
                ((ref["logprobs"] - cand["logprobs"]).abs() / ref["logprobs"].abs().clamp(min=1))[counted].max()
            ),
            "grad_diff": float((ref["grads"] - cand["grads"]).abs().max()),
            "grad_scale": float(ref["grads"].abs().max()),
            reference[0]: ref["metrics"],
            candidate[0]: cand["metrics"],
            "mismatched": [c["probe"].mismatched for c in (ref, cand) if c["probe"]],
            "checked": [c["probe"].checked for c in (ref, cand) if c["probe"]],
        }
    return out


def sft_scenario(learner: Learner, hf_dir: str, packed: bool) -> dict:
    """One SFT step on micro-batches of three widths (rows 0-3, 4-8, 9-15 of the fixed batch),
    or packed (sft.pack_sequences: the rows back to back in rows of at most 35 tokens, two rows a
    micro-batch, padded at their ends), against
    the masked cross-entropy computed by hand from HF's logprobs; then the export, scored by HF
    transformers as an engine would load it."""
    from megatron_rlvr.sft.data import Example, pack_micro_batches
    from megatron_rlvr.sft.rank import export_hf_folder

    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    micro = [
        TrainBatch(batch.input_ids[rows, :width], batch.response_mask[rows, :width])
        for rows, width in ((slice(0, 4), 10), (slice(4, 9), 11), (slice(9, 16), 12))
    ]
    if packed:
        rows = [
            Example(ids[:n].tolist(), mask[:n].int().tolist())
            for ids, mask, n in zip(batch.input_ids, batch.response_mask, row_extents(batch).tolist())
        ]
        micro = pack_micro_batches(rows, micro_batch_tokens=70, pad_id=0, packed=True, row_tokens=35)
        assert len(micro) == 2 and all(mb.size == 2 and mb.segments is not None for mb in micro)
        assert any((mb.segments == -1).any() for mb in micro)  # rows padded at their ends
    reference = hf_logprobs(hf_dir, batch.input_ids)
    by_hand = float(-(reference * batch.response_mask).sum() / batch.response_mask.sum())
    heldout = learner.sft_step(micro, train=False)
    metrics = learner.sft_step(micro)
    after = learner.compute_logprobs(batch, old_logprob_pass=False)
    out = os.path.join(os.path.dirname(os.environ["RESULT"]), "exported")
    export_hf_folder(learner, hf_dir, out, write=int(os.environ.get("RANK", 0)) == 0)
    result = {"by_hand": by_hand, "heldout": heldout, "metrics": metrics, "logprobs_after_step": after.tolist()}
    if int(os.environ.get("RANK", 0)) == 0:
        result["export_vs_learner"] = float((hf_logprobs(out, batch.input_ids) - after)[:, 1:].abs().max())
        result["exported"] = out
    return result


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # into the rank's log
    scenario, hf_dir, *rest = sys.argv[1:]
    if os.environ.get("SIMULATE_GPU_HOST"):  # CUDA "available" but unusable: a CPU run must not use it
        torch.cuda.is_available = lambda: True
        # torch.compile (Megatron's fused router functions) saves and restores the CUDA RNG
        # whenever CUDA is available, which a real GPU host answers; a stand-in answers here
        torch.cuda.get_rng_state = lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8)
        torch.cuda.set_rng_state = lambda *args, **kwargs: None
    ckpt = rest.pop(0) if scenario.startswith("ckpt") else None
    cfg = load_config(None, [*BASE, *rest])
    init_parallel(cfg.parallel, seed=cfg.trainer.seed)
    if scenario in ("budget", "packed"):  # builds its own learners
        with open(os.environ["RESULT"], "w") as f:
            json.dump((budget_equality if scenario == "budget" else packed_equality)(hf_dir, rest), f)
        destroy_parallel()
        return
    learner = Learner(cfg, hf_dir)
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    if scenario == "parity":
        result = parity(learner, hf_dir)
    elif scenario in ("sft", "sft-packed"):
        result = sft_scenario(learner, hf_dir, packed=scenario == "sft-packed")
    elif scenario == "descent":
        result = descent(learner)
    elif scenario.startswith("epochs-x"):  # epochs-xN: N train steps
        result = epochs_scenario(learner, hf_dir, int(scenario.removeprefix("epochs-x")))
    elif scenario == "ckpt-specs":
        result = checkpoint_specs(learner, ckpt)
    elif scenario == "entropy":
        result = entropy_check()
    elif scenario == "replay-r2":
        result = replay_r2(learner, hf_dir)
    elif scenario in ("sync", "sync-integrity"):
        result = sync_scenario(learner, os.environ["ENGINE_URLS"].split(","), scenario == "sync-integrity")
    elif scenario == "replay-errors":
        result = replay_errors(learner)
    elif scenario in ("replay-r3", "replay-r3-perturbed"):
        result = replay_r3(learner, hf_dir, perturb=scenario.endswith("perturbed"))
    elif scenario == "short-batch":
        result = short_batch(learner, hf_dir)
    elif scenario == "ckpt-save":
        batch = with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids))
        learner.train_step(batch)
        if os.environ.get("SAVE_AS_GPU"):
            save_as_if_on_gpu()
        save_checkpoint(learner, ckpt)
        result = {"logprobs": learner.compute_logprobs(batch).tolist()}
        learner.train_step(batch)  # the uninterrupted run's next step, for resume checks
        result["logprobs_next"] = learner.compute_logprobs(batch).tolist()
    elif scenario == "ckpt-load":
        step = load_checkpoint(learner, ckpt)
        result = {"step": step, "logprobs": learner.compute_logprobs(batch).tolist()}
        learner.train_step(with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids)))
        result["logprobs_next"] = learner.compute_logprobs(batch).tolist()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
