"""The plan as text tables, and the fit check `submit` applies: refuse a rank over its GPU's
memory (one line: the largest term and what would make it fit), warn above WARN_SHARE."""

from __future__ import annotations

from megatron_rlvr.errors import UserError
from megatron_rlvr.plan.build import MemoryPlan, RankPlan
from megatron_rlvr.plan.engines import GB

WARN_SHARE = 0.9

# what shrinks each term, for the refusal
REMEDIES = {
    "parameters": "more parallel.ep (experts ÷ ep) or parallel.pp (layers ÷ pp), or more parallel.tp",
    "gradients": "more parallel.ep or parallel.pp, or more parallel.tp",
    "optimizer": "more parallel.ep or parallel.pp, more data-parallel ranks with trainer.distributed_optimizer=true",
    "activations": "trainer.recompute_activations=true, a smaller trainer.max_tokens_per_microbatch or "
    "trainer.micro_batch_size, or more parallel.tp / parallel.pp",
    "recompute layer": "a smaller trainer.max_tokens_per_microbatch or trainer.micro_batch_size, or more parallel.tp",
    "forward layer": "a smaller trainer.max_tokens_per_logprob_microbatch, or more parallel.tp",
    "logits": "a smaller token budget (trainer.max_tokens_per_microbatch, trainer.max_tokens_per_logprob_microbatch "
    "or trainer.micro_batch_size) or more parallel.tp (splits the vocabulary); the logprob pass is already chunked",
    "routing replay": "a smaller token budget or more parallel.tp",
    "sync buckets": "a smaller weight_sync.bucket_mb",
    "weights": "more rollout.engine.tp",
    "KV cache": "a lower rollout.engine.mem_fraction_static or more rollout.engine.tp",
    "outside the pool": "a lower rollout.engine.mem_fraction_static or a smaller weight_sync.bucket_mb",
}


class MemoryPlanError(UserError, ValueError):
    """A layout whose most loaded rank does not fit its GPU."""


def _gb(n: int) -> str:
    return f"{n / GB:7.2f} GB"


def rank_table(rank: RankPlan) -> list[str]:
    width = max(len(t.name) for t in rank.terms)
    phases = any(t.phase for t in rank.terms)
    lines = [f"{rank.title}:"]
    for term in rank.terms:
        where = "host" if term.host else term.phase or "always"
        lines.append(f"  {term.name:<{width}}  {_gb(term.bytes)}  {f'{where:<7}  ' if phases else ''}{term.inputs}")
    share = rank.device_bytes / rank.capacity
    peak = f"always + {rank.peak_phase}, " if rank.peak_phase else ""
    lines.append(
        f"  {'peak':<{width}}  {_gb(rank.device_bytes)}  {'' if not phases else ' ' * 9}"
        f"{peak}of {rank.capacity / GB:g} GB per GPU ({share:.0%})"
    )
    return lines


def lines(plan: MemoryPlan) -> list[str]:
    out = [f"model    {plan.model}", f"layout   {plan.layout}", *[f"assumes  {n}" for n in plan.notes]]
    if plan.learner:
        out += rank_table(plan.learner)
    else:
        out.append("learner: on CPU (no GPU memory to plan)")
    if plan.engine and plan.engine_memory:
        out += rank_table(plan.engine)
    else:
        out.append("engines: CPU engines (no GPU memory to plan)")
    s = plan.sync
    out.append(
        f"weight sync: {s.bytes / GB:.2f} GB per sync in {s.buckets} buckets, {s.seconds:.1f} s at "
        f"{s.link_gbps:g} Gb/s (--link-gbps)"
    )
    return out


def _engine_problem(plan: MemoryPlan) -> tuple[str, str] | None:
    mem, rank = plan.engine_memory, plan.engine
    if mem is None or rank is None:
        return None
    if mem.kv_pool <= 0:
        return "weights", (
            f"engine GPU: weights {mem.weights / GB:.1f} GB exceed mem_fraction_static's "
            f"{mem.static / GB:.1f} GB (no room for a KV cache)"
        )
    if mem.outside_pool > mem.outside_room:
        return "outside the pool", (
            f"engine GPU: {mem.outside_pool / GB:.1f} GB needed outside the static pool, "
            f"{mem.outside_room / GB:.1f} GB left there"
        )
    return None


def check(plan: MemoryPlan) -> list[str]:
    """Raises MemoryPlanError (one line) when a GPU is over its memory; returns warnings."""
    warnings = []
    if plan.learner:
        rank = plan.learner
        if rank.device_bytes > rank.capacity:
            big = rank.largest()
            raise MemoryPlanError(
                f"the most loaded learner rank needs {rank.device_bytes / GB:.1f} GB of {rank.capacity / GB:g} GB "
                f"({plan.layout}); largest term: {big.name} {big.bytes / GB:.1f} GB; to fit: {REMEDIES[big.name]} "
                "(--no-memory-check to submit anyway)"
            )
        if rank.device_bytes > WARN_SHARE * rank.capacity:
            warnings.append(
                f"the most loaded learner rank needs {rank.device_bytes / GB:.1f} GB, "
                f"{rank.device_bytes / rank.capacity:.0%} of {rank.capacity / GB:g} GB: little headroom"
            )
    problem = _engine_problem(plan)
    if problem:
        term, text = problem
        raise MemoryPlanError(f"{text}; to fit: {REMEDIES[term]} (--no-memory-check to submit anyway)")
    return warnings
