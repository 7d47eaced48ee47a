"""A run's memory plan from its resolved config: the most loaded learner rank's terms (each
pipeline stage is planned, the largest kept), one engine GPU's, and the weight sync.

A learner rank holds its model state throughout and goes through three phases one after the
other: the logprob pass (forward only), the train step, the weight sync. Its peak is the
model state plus the largest phase."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlvr.config import HFModel, ResolvedConfig, SglangEngine, TinyModel
from megatron_rlvr.plan import activations as act
from megatron_rlvr.plan.engines import GB, LINK_GBPS, EngineMemory, SyncCost, engine_memory, sync_cost
from megatron_rlvr.plan.model_state import DTYPE_BYTES, Layout, state_bytes
from megatron_rlvr.plan.shape import ModelShape, read_config_json, shape_from_hf

TRAIN, LOGPROB, SYNC = "train", "logprob", "sync"  # a learner rank's phases: one at a time
DEFAULT_PROMPT_TOKENS = 1024  # assumed longest prompt; the config does not bound prompts


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    inputs: str  # the formula's inputs, for the table
    phase: str = ""  # "": held throughout; else held only in that phase (train, logprob pass, sync)
    host: bool = False  # host memory, not counted against the GPU


@dataclass
class RankPlan:
    title: str
    terms: list[Term]
    capacity: int  # GPU bytes

    def phase_bytes(self) -> dict[str, int]:
        """GPU bytes held throughout ("") and in each phase; the phases do not overlap."""
        sums: dict[str, int] = {"": 0}
        for t in self.terms:
            if not t.host:
                sums[t.phase] = sums.get(t.phase, 0) + t.bytes
        return sums

    @property
    def peak_phase(self) -> str:
        phases = {k: v for k, v in self.phase_bytes().items() if k}
        return max(phases, key=lambda k: phases[k]) if phases else ""

    @property
    def device_bytes(self) -> int:
        """The peak: what is held throughout plus the largest phase."""
        sums = self.phase_bytes()
        return sums[""] + (sums[self.peak_phase] if self.peak_phase else 0)

    def largest(self) -> Term:
        return max((t for t in self.terms if not t.host), key=lambda t: t.bytes)


@dataclass
class MemoryPlan:
    model: str
    layout: str
    learner: RankPlan | None  # None: the learner runs on CPU
    engine: RankPlan | None  # None: CPU engines
    engine_memory: EngineMemory | None
    sync: SyncCost
    notes: list[str] = field(default_factory=list)


def model_shape(cfg: ResolvedConfig) -> ModelShape:
    if isinstance(cfg.model, HFModel):
        return shape_from_hf(read_config_json(cfg.model.path))
    assert isinstance(cfg.model, TinyModel)
    return shape_from_hf(tiny_config(cfg.model))


def tiny_config(spec: TinyModel) -> dict:
    """The config.json tiny_model.py writes for `spec` (vocabulary: the character tokenizer's)."""
    from megatron_rlvr.data.arithmetic import SPECIALS

    vocab = spec.vocab_size or len(SPECIALS) + len(set(spec.tokenizer_chars))
    return {
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "intermediate_size": spec.moe_intermediate_size * 2,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vocab_size": vocab,
    }


def step_batch(cfg: ResolvedConfig, prompt_tokens: int) -> act.Batch:
    t, p = cfg.trainer, cfg.parallel
    seq_len = prompt_tokens + cfg.rollout.max_new_tokens
    rows = cfg.buffer.batch_groups * cfg.rollout.n_samples_per_prompt
    rows_per_rank = -(-rows // p.dp)
    per_minibatch = -(-rows_per_rank // cfg.algo.num_minibatches)
    if t.max_tokens_per_microbatch:
        train_tokens = max(t.max_tokens_per_microbatch, seq_len)  # a longer row goes alone
        micro = -(-per_minibatch * seq_len // t.max_tokens_per_microbatch)
    else:
        train_tokens = min(t.micro_batch_size, per_minibatch) * seq_len
        micro = -(-per_minibatch // t.micro_batch_size)
    budget = t.max_tokens_per_logprob_microbatch or t.max_tokens_per_microbatch
    logprob_tokens = max(budget, seq_len) if budget else train_tokens
    return act.Batch(seq_len, train_tokens, logprob_tokens, micro, rows_per_rank, rows)


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def learner_plan(cfg: ResolvedConfig, shape: ModelShape, gpu_bytes: int, prompt_tokens: int) -> RankPlan:
    p, t = cfg.parallel, cfg.trainer
    layout = Layout(p.tp, p.pp, p.dp, p.ep, p.etp)
    a = DTYPE_BYTES[t.dtype]
    sp = p.tp if p.sequence_parallel else 1
    batch = step_batch(cfg, prompt_tokens)
    bucket = int(cfg.weight_sync.bucket_mb * 2**20)
    plans = [_stage_plan(cfg, shape, layout, stage, batch, a, sp, bucket, gpu_bytes) for stage in range(p.pp)]
    return max(plans, key=lambda plan: plan.device_bytes)


def _stage_plan(
    cfg: ResolvedConfig,
    shape: ModelShape,
    layout: Layout,
    stage: int,
    batch: act.Batch,
    a: int,
    sp: int,
    bucket: int,
    gpu_bytes: int,
) -> RankPlan:
    t = cfg.trainer
    dist = t.distributed_optimizer
    state = state_bytes(shape, layout, stage, dtype=t.dtype, distributed=dist, norms_fp32=cfg.parallel.device == "cpu")
    shard = f"dense ÷ dp {layout.dp}, experts ÷ expert-dp {layout.expert_dp}" if dist else "not sharded"
    numel = f"{state.dense_numel / 1e9:.3f}B dense + {state.expert_numel / 1e9:.3f}B expert elements"
    flight = act.in_flight(layout, stage, batch.micro_batches)
    tokens = batch.train_tokens
    activ = act.activation_bytes(shape, layout, stage, tokens, sp=sp, a=a, recompute=t.recompute_activations)
    terms = [
        Term("parameters", state.params, f"{numel} × {a} B ({t.dtype})"),
        Term("gradients", state.grads, "fp32 grad buffer (grad_reduce_in_fp32)"),
        Term("optimizer", state.optimizer, f"Adam m+v 8 B (+ fp32 master 4 B for 16-bit), {shard}"),
        Term(
            "activations",
            activ * flight,
            f"{tokens} tokens/micro-batch × {flight} in flight (1F1B, stage {stage} of {layout.pp}), "
            f"{'full recompute' if t.recompute_activations else 'no recompute'}, sp {sp}",
            phase=TRAIN,
        ),
    ]
    if t.recompute_activations:
        work = act.recompute_working_bytes(shape, layout, stage, tokens, sp=sp, a=a)
        terms.append(Term("recompute layer", work, f"one layer rebuilt in backward, {tokens} tokens", phase=TRAIN))
    lp_tokens = batch.logprob_tokens
    terms.append(
        Term(
            "forward layer",
            act.recompute_working_bytes(shape, layout, stage, lp_tokens, sp=sp, a=a),
            f"one layer's working set, {lp_tokens} tokens (no graph kept)",
            phase=LOGPROB,
        )
    )
    if stage == layout.pp - 1:
        vocab = f"V/tp {shape.vocab // layout.tp} × {a} B"
        terms += [
            Term(
                "logits",
                act.logits_bytes(shape, layout, tokens, a, train=True),
                f"{tokens} tokens × {vocab}, twice (logits, gradient) + 2 fp32 chunks",
                phase=TRAIN,
            ),
            Term(
                "logits",
                act.logits_bytes(shape, layout, lp_tokens, a, train=False),
                f"{lp_tokens} tokens × {vocab} + 2 fp32 chunks (chunked)",
                phase=LOGPROB,
            ),
        ]
    replay = cfg.algo.routing_replay
    if replay != "none" or cfg.rollout.return_routed_experts:
        kept = flight if t.recompute_activations else 1
        terms.append(
            Term(
                "routing replay",
                act.r3_device_bytes(shape, layout, stage, tokens, sp, kept),
                f"int64 targets [tokens/sp, top-{shape.top_k}] per MoE layer × {kept} micro-batch(es)",
                phase=TRAIN,
            )
        )
        if cfg.rollout.return_routed_experts:
            terms.append(
                Term(
                    "R3 routing (host)",
                    act.r3_host_bytes(shape, batch),
                    f"{batch.batch_rows} rows × {batch.seq_len} × {shape.num_layers} layers × top-{shape.top_k} × "
                    f"{act.compact_bytes(shape.num_experts)} B",
                    host=True,
                )
            )
        if replay == "r2":
            terms.append(
                Term(
                    "R2 recorded (host)",
                    act.r2_host_bytes(shape, layout, stage, batch),
                    f"{batch.rows_per_rank} rows × {batch.seq_len} × stage MoE layers × top-{shape.top_k}",
                    host=True,
                )
            )
    terms.append(
        Term(
            "sync buckets",
            act.sync_bytes(shape, layout, bucket, a),
            f"bucket {cfg.weight_sync.bucket_mb:g} MiB + largest tensor gathered whole",
            phase=SYNC,
        )
    )
    title = f"learner rank, pipeline stage {stage} ({layout.text()})"
    return RankPlan(title, terms, gpu_bytes)


def engine_plan(
    cfg: ResolvedConfig, shape: ModelShape, gpu_bytes: int, prompt_tokens: int
) -> tuple[RankPlan, EngineMemory]:
    engine = cfg.rollout.engine
    assert isinstance(engine, SglangEngine)
    bucket = int(cfg.weight_sync.bucket_mb * 2**20)
    mem = engine_memory(
        shape,
        tp=engine.tp,
        dtype=engine.dtype,
        mem_fraction_static=engine.mem_fraction_static,
        gpu_bytes=gpu_bytes,
        bucket_bytes=bucket,
    )
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    heads = "MLA latent" if shape.mla else f"{max(1, shape.num_kv_heads // engine.tp)} of {shape.num_kv_heads} KV heads"
    terms = [
        Term(
            "weights", mem.weights, f"{shape.total_params() / 1e9:.2f}B params ÷ engine tp {engine.tp}, {engine.dtype}"
        ),
        Term(
            "KV cache",
            max(0, mem.kv_pool),
            f"mem_fraction_static {engine.mem_fraction_static} − weights; {mem.kv_per_token} B/token ({heads}) "
            f"→ {mem.concurrent_tokens} tokens = {mem.concurrent_tokens // seq} sequences of {seq}",
        ),
        Term(
            "outside the pool",
            mem.outside_pool,
            f"activations + CUDA graphs (assumed 3 GB) + one sync bucket; room: {_gb(mem.outside_room)}",
        ),
    ]
    return RankPlan(f"engine GPU (tp {engine.tp}, ep {engine.ep})", terms, gpu_bytes), mem


def plan_run(
    cfg: ResolvedConfig,
    gpu_gb: float = 80.0,
    link_gbps: float | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> MemoryPlan:
    shape = model_shape(cfg)
    gpu_bytes = int(gpu_gb * GB)
    learner = learner_plan(cfg, shape, gpu_bytes, prompt_tokens) if cfg.parallel.device == "cuda" else None
    engine = cfg.rollout.engine
    on_gpu = isinstance(engine, SglangEngine) and engine.device == "cuda"
    engine_rank, engine_mem = engine_plan(cfg, shape, gpu_bytes, prompt_tokens) if on_gpu else (None, None)
    engine_dtype = engine.dtype
    rate = link_gbps or LINK_GBPS[cfg.weight_sync.backend]
    sync = sync_cost(shape, dtype=engine_dtype, bucket_bytes=int(cfg.weight_sync.bucket_mb * 2**20), link_gbps=rate)
    p = cfg.parallel
    layout = f"tp {p.tp} · pp {p.pp} · dp {p.dp} · ep {p.ep} · etp {p.etp}"
    model = (
        f"{shape.model_type}: {shape.total_params() / 1e9:.2f}B params ({shape.active_params() / 1e9:.2f}B active), "
        f"{shape.num_layers} layers, {shape.num_experts} experts × top-{shape.top_k}, vocab {shape.vocab}"
    )
    notes = [f"sequences of {prompt_tokens} prompt + {cfg.rollout.max_new_tokens} new tokens (--prompt-tokens)"]
    return MemoryPlan(model, layout, learner, engine_rank, engine_mem, sync, notes)
