"""The CPU rollout engine: SGLang's generation semantics on top of HF transformers.

One scheduler thread batches continuously: a sequence that finishes leaves the batch at that
step, and waiting sequences join the running batch (prefilled together, their KV cache merged
into the running one: rollout/cohort.py) once a quarter of the slots is free for them, so a
long sequence holds one slot, not the whole batch. A step's rows are sampled together
(rollout/sampling.py), each from its own seed's stream. Between decode steps it honours aborts
and pauses (abort, retract: drop the KV and re-prefill later under whatever weights are loaded
then, in_place: keep the KV and wait; the tokens sampled after continue come from the new
weights, and each output token is tagged with the weight version of the forward that produced
its logits). Every token that goes through the model has its router top-k recorded, so
`routed_experts` covers exactly positions 0 … seq_len − 2, as SGLang's does. Logprobs are of the temperature-scaled distribution
(log_softmax(logits / T); raw logits when T = 0), before top-p/top-k truncation.

Weights live in the transformers model; `weights` addresses them by HF checkpoint names with
experts one by one (transformers 5 fuses experts in memory), which is what updates carry.
While memory is released (rollout/memory_api.py) `released` names what is gone and new
requests are refused.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_rlvr.families import Family, family_of, read_hf_config
from megatron_rlvr.rollout.cohort import Cohort
from megatron_rlvr.rollout.protocol import FinishReason, SamplingParams
from megatron_rlvr.rollout.sampling import sample_rows

GENERATION_MEMORY = frozenset({"weights", "kv_cache"})  # released tags that stop generation


class EngineError(ValueError):
    """A request this engine refuses (HTTP 400), with a message naming the problem."""


@dataclass
class Sequence:
    """One sample being generated."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: Future = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    routing: list[np.ndarray] = field(default_factory=list)  # [layers, k] per fed position
    finish: FinishReason | None = None
    aborted: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def expert_weight_table(model: torch.nn.Module, family: Family | None = None) -> dict[str, torch.Tensor]:
    """HF checkpoint name → tensor (or view) in the loaded model, for every parameter and
    persistent buffer (an expert score bias is one). Names are the checkpoint's, which is what
    updates carry: the family's legacy module names (Mixtral's `block_sparse_moe`, `w1/w3/w2`),
    and fused expert tensors exposed one expert at a time (`…experts.E.gate_proj.weight` is a
    view into gate_up_proj) unless the checkpoint stores them fused too (gpt-oss)."""
    family = family or family_of(model.config)
    gate, up, down = family.expert_names

    def checkpoint_name(name: str) -> str:
        for runtime, stored in family.checkpoint_renames:
            name = name.replace(runtime, stored)
        return name

    table: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        data = tensor.data
        if family.fused_experts:
            table[name] = data
        elif name.endswith("experts.gate_up_proj"):
            prefix, half = checkpoint_name(name[: -len("gate_up_proj")]), data.shape[1] // 2
            for e in range(data.shape[0]):
                table[f"{prefix}{e}.{gate}.weight"] = data[e, :half]
                table[f"{prefix}{e}.{up}.weight"] = data[e, half:]
        elif name.endswith("experts.down_proj"):
            prefix = checkpoint_name(name[: -len("down_proj")])
            for e in range(data.shape[0]):
                table[f"{prefix}{e}.{down}.weight"] = data[e]
        else:
            table[checkpoint_name(name)] = data
    if getattr(model.config, "tie_word_embeddings", False):
        table.pop("lm_head.weight", None)
    return table


class CpuEngine:
    def __init__(self, model_dir: str, *, dtype: str = "float32", max_batch: int = 64, weight_version: str = "0"):
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.family = family_of(read_hf_config(model_dir))
        # the checkpoint's own config (an alias such as kimi_k2 as its family's)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=read_hf_config(model_dir), dtype=getattr(torch, dtype)
        )
        self.model.eval()
        self.config = self.model.config
        self.weights = expert_weight_table(self.model, self.family)
        self.tokenizer = _maybe_tokenizer(model_dir)
        self.eos_ids = _eos_ids(self.model)
        self.max_batch = max_batch
        self.join_size = max(1, max_batch // 4)  # the fewest newcomers a join waits for (_room_to_admit)
        self.weight_version = weight_version
        self.context_length = int(getattr(self.config, "max_position_embeddings", 4096))
        self._routing_step: dict[int, torch.Tensor] = {}  # layer → top-k ids of the last forward
        self._moe_layers = self._hook_routers()
        self.model_lock = threading.Lock()  # held around forwards and weight writes
        self._cond = threading.Condition()
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._paused: str | None = None  # None | "abort" | "retract" | "in_place"
        self._stopped = False
        self.released: set[str] = set()  # memory tags released (rollout/memory_api.py)
        self._stepping = False  # the scheduler is inside a step (prefill or decode), lock released
        self._seeds = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="cpu-engine", daemon=True)
        self._thread.start()

    def _hook_routers(self) -> list[int]:
        """Forward hooks on every MoE layer's router (the family's `mlp.<router>`): HF routers
        return the expert ids they chose (order included) as the last element of their output.
        A MoE model in which no router is found is refused: it would capture nothing, silently."""
        moe_layers = []
        for index, layer in enumerate(self.model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), self.family.router, None)
            if gate is None or not hasattr(gate, "top_k"):
                continue
            moe_layers.append(index)

            def keep(module, args, output, index=index):
                self._routing_step[index] = output[-1].detach()

            gate.register_forward_hook(keep)
        if not moe_layers:
            raise EngineError(
                f"no router `mlp.{self.family.router}` with top_k found in "
                f"{type(self.model).__name__}: routed experts could not be captured"
            )
        return moe_layers

    # ------------------------------------------------------------------ requests
    def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str | None) -> list[Sequence]:
        """Queues n samples of one prompt; each sequence's future resolves when it finishes."""
        if not prompt_ids:
            raise EngineError("input_ids is empty")
        vocab = self.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise EngineError(f"input_ids holds token ids outside the vocabulary [0, {vocab})")
        if len(prompt_ids) + params.max_new_tokens > self.context_length:
            raise EngineError(
                f"the input ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"is longer than the model's context length ({self.context_length} tokens)"
            )
        if params.stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        rid = rid or uuid.uuid4().hex
        base = params.sampling_seed
        seqs = [
            Sequence(
                rid=rid,
                prompt_ids=list(prompt_ids),
                params=params,
                seed=(base + i) if base is not None else next(self._seeds) * 7919,
            )
            for i in range(params.n)
        ]
        with self._cond:
            if self.released & GENERATION_MEMORY:
                raise EngineError(
                    f"generation refused: memory released ({', '.join(sorted(self.released))}); "
                    "call /resume_memory_occupation first"
                )
            self._waiting.extend(seqs)
            self._cond.notify_all()
        return seqs

    def mark_released(self, tags: set[str]) -> None:
        """Records tags as released, refused (as SGLang asserts an idle server) while any
        request runs or holds a KV cache, or waits while generation is not paused. Requests
        retracted by a pause wait on, admitted once everything is resumed and continued."""
        with self._cond:
            queued = [] if self._paused else self._waiting
            pending = [s for s in queued + self._running if not s.future.done()]
            if pending:
                raise EngineError(
                    f"release_memory_occupation refused: {len(pending)} requests are queued or running; "
                    "the engine must be idle (let them finish or abort them)"
                )
            self.released |= tags

    def mark_resumed(self, tags: set[str]) -> None:
        with self._cond:
            self.released -= tags
            self._cond.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Marks matching sequences aborted: waiting ones finish at once, running ones at the
        next decode step (with what they generated so far). Returns how many matched."""
        with self._cond:
            matched = [s for s in self._waiting + self._running if abort_all or s.rid == rid]
            for seq in matched:
                seq.aborted = True
            for seq in [s for s in self._waiting if s.aborted]:
                self._waiting.remove(seq)
                self._finish(seq, FinishReason(type="abort", message="aborted"))
            self._cond.notify_all()
        return len(matched)

    def pause(self, mode: str, park_timeout_s: float = 120.0) -> None:
        """Pauses generation. Returns once the scheduler stands between steps (a forward in
        progress has finished), so weights loaded after this never meet a forward that
        started before it, and every token is tagged with the version that computed it."""
        with self._cond:
            self._paused = mode
            if mode == "abort":
                for seq in self._waiting + self._running:
                    seq.aborted = True
                for seq in list(self._waiting):
                    self._waiting.remove(seq)
                    self._finish(seq, FinishReason(type="abort", message="generation paused (abort)"))
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: not self._stepping or self._stopped, park_timeout_s):
                raise EngineError(f"generation did not stop between decode steps within {park_timeout_s:.0f} s")

    def resume(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused is not None

    @property
    def busy(self) -> bool:
        """Sequences holding a KV cache (running, or paused in place)."""
        with self._cond:
            return bool(self._running)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        """Each turn: apply aborts and pauses, admit waiting sequences into free slots
        (prefilled together, merged into the running batch), then one decode step for every
        running sequence. A finished sequence leaves its slot at the step it finishes."""
        cohorts: list[Cohort] = []
        while True:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()  # a pause waiting for the step to end
                cohorts = self._between_steps(cohorts)
                while not self._stopped and not cohorts and (self._admission_held() or not self._waiting):
                    self._cond.wait()
                if self._stopped:
                    return
                room = 0 if self._admission_held() else self._room_to_admit(sum(len(c.seqs) for c in cohorts))
                joiners, self._waiting = self._waiting[:room], self._waiting[room:]
                self._running = [s for c in cohorts for s in c.seqs] + joiners
                self._stepping = True
            try:
                if joiners:
                    newcomers = self._prefill(joiners)
                    if not (cohorts and cohorts[0].merge(newcomers)):
                        cohorts.append(newcomers)
                cohorts = [c for c in cohorts if self._decode(c)]
            except Exception as err:  # a broken step must not strand its requests
                for seq in self._running:
                    if not seq.future.done():
                        seq.future.set_exception(err)
                cohorts = []

    def _admission_held(self) -> bool:
        """Nothing joins while generation is paused or its memory is released."""
        return self._paused is not None or bool(self.released & GENERATION_MEMORY)

    def _room_to_admit(self, running: int) -> int:
        """How many waiting sequences join this step. Admission goes in batches: a join costs a
        prefill and a cache merge, each about one decode forward, so newcomers join when the
        free slots take a quarter of the batch or all that wait (at once when nothing runs),
        not one at a time as slots free."""
        free = self.max_batch - running
        return free if running == 0 or free >= min(len(self._waiting), self.join_size) else 0

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish = reason
        if not seq.future.done():
            seq.future.set_result(seq)

    def _forward(self, ids, attention, positions, past):
        """One forward under the model lock; returns it with the weight version it ran under."""
        with self.model_lock, torch.no_grad():
            self._routing_step.clear()
            out = self.model(
                input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=past, use_cache=True
            )
            return out, self.weight_version

    def _prefill(self, batch: list[Sequence]) -> Cohort:
        width = max(len(s.tokens) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for i, seq in enumerate(batch):
            ids[i, width - len(seq.tokens) :] = torch.tensor(seq.tokens)
            attention[i, width - len(seq.tokens) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        for seq in batch:
            seq.routing = []  # a (re)prefill routes every position again, under current weights
        out, version = self._forward(ids, attention, positions, None)
        self._record_routing(batch, out, [len(s.tokens) for s in batch])
        return Cohort(
            seqs=list(batch),
            cache=out.past_key_values,
            attention=attention,
            positions=positions[:, -1],
            logits=out.logits[:, -1].float(),
            versions=[version] * len(batch),
        )

    def _decode(self, cohort: Cohort) -> bool:
        """Samples every row's next token from its pending logits, drops the rows that
        finished, and runs the forward of the rest; False when none is left."""
        next_ids, going = [], []
        tokens, logprobs = sample_rows(
            cohort.logits,
            [s.params for s in cohort.seqs],
            [s.seed for s in cohort.seqs],
            [len(s.output_ids) for s in cohort.seqs],
        )
        for i, (seq, token, logprob) in enumerate(zip(cohort.seqs, tokens, logprobs)):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(cohort.versions[i])
            reason = self._stop_reason(seq, token)
            if reason is None:
                going.append(i)
                next_ids.append(token)
            else:
                self._finish(seq, reason)
        cohort.keep(going)
        if not going:
            return False
        attention = torch.cat([cohort.attention, torch.ones(len(going), 1, dtype=torch.long)], dim=1)
        positions = cohort.positions + 1
        out, version = self._forward(torch.tensor(next_ids)[:, None], attention, positions[:, None], cohort.cache)
        self._record_routing(cohort.seqs, out, [1] * len(going))
        cohort.cache, cohort.attention, cohort.positions = out.past_key_values, attention, positions
        cohort.logits, cohort.versions = out.logits[:, -1].float(), [version] * len(going)
        return True

    def _between_steps(self, cohorts: list[Cohort]) -> list[Cohort]:
        """Applies aborts and pauses between decode steps (the caller holds the lock): aborted
        sequences finish with what they have, retract sends every running sequence back to
        the queue (its KV dropped, re-prefilled after continue under the weights loaded
        then), in_place waits here with every KV cache kept. Returns the cohorts left."""
        for cohort in cohorts:
            aborted = [seq for seq in cohort.seqs if seq.aborted]
            for seq in aborted:
                self._finish(seq, FinishReason(type="abort", message="aborted"))
            cohort.keep([i for i, seq in enumerate(cohort.seqs) if not seq.aborted])
        cohorts = [c for c in cohorts if c.seqs]
        if self._paused == "retract" and cohorts:
            self._waiting = [s for c in cohorts for s in c.seqs] + self._waiting
            cohorts = []
        self._running = [s for c in cohorts for s in c.seqs]
        while self._paused == "in_place" and not self._stopped:
            self._cond.wait()
        return cohorts

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids:
            return FinishReason(type="stop", matched=token)
        if p.stop_token_ids and token in p.stop_token_ids:
            return FinishReason(type="stop", matched=token)
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids)
            for stop in [p.stop] if isinstance(p.stop, str) else p.stop:
                if stop and text.endswith(stop):
                    return FinishReason(type="stop", matched=stop)
        if len(seq.output_ids) >= p.max_new_tokens:
            return FinishReason(type="length", length=len(seq.output_ids))
        return None

    def _record_routing(self, batch: list[Sequence] | list[Sequence | None], out, fed: list[int]) -> None:
        """Router choices for the tokens this forward fed, per sequence: [fed, layers, k]
        (all hidden layers; dense layers, which route nothing, hold zeros)."""
        if not self._moe_layers:
            return
        steps = out.logits.shape[1]
        k = self.config.num_experts_per_tok
        routing = torch.zeros(len(batch), steps, self.config.num_hidden_layers, k, dtype=torch.int32)
        for layer in self._moe_layers:
            routing[:, :, layer] = self._routing_step[layer].view(len(batch), steps, k).to(torch.int32)
        chosen = routing.numpy()
        for i, seq in enumerate(batch):
            if seq is not None:
                seq.routing.extend(chosen[i, steps - fed[i] :])


def _maybe_tokenizer(model_dir: str):
    from pathlib import Path

    if not any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _eos_ids(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
