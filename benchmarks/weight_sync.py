"""Weight-sync transport: flattened buckets vs the wire's limit vs per-tensor broadcast.

An expert-heavy parameter set shaped like a real MoE (per-expert HF-named tensors, bf16),
sent from a learner process to engine processes over a gloo update group formed exactly as
the engines join it. The receivers run the CPU engine's own receive path (one broadcast per
bucket, views at aligned offsets, copy into the model's tensors). The announcement HTTP call
per bucket is left out: both sides derive the bucket plan from the same parameter list.
Reports, per bucket size:
  (a) flattened-bucket sync: pack (pipelined with the wire) + one broadcast per bucket + load;
  (b) transport limit: one broadcast of a single tensor of the same total bytes;
  (c) per-tensor broadcast of the same set, loaded the same way.
Each phase starts with every process ready and ends when every engine has finished (a
barrier on both sides), so it measures time to weights-in-place, not time to hand-off.

    .venv/bin/python benchmarks/weight_sync.py [--engines 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.multiprocessing as mp

from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout.weight_receiver import receive_bucket, receive_tensors
from megatron_rlvr.weight_sync.buckets import buckets
from megatron_rlvr.weight_sync.transport import broadcast, open_group

BUCKET_MB = (16, 32, 64, 128, 256, 512, 1024)


def moe_parameters(
    layers: int = 16, experts: int = 32, hidden: int = 512, ffn: int = 160
) -> list[tuple[str, torch.Tensor]]:
    """~1,650 bf16 tensors, ~280 MB: attention per layer plus gate/up/down per expert."""
    gen = torch.Generator().manual_seed(0)
    params = [("model.embed_tokens.weight", torch.randn(8192, hidden, generator=gen))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            params.append((f"{prefix}.self_attn.{proj}.weight", torch.randn(hidden, hidden, generator=gen)))
        params.append((f"{prefix}.mlp.gate.weight", torch.randn(experts, hidden, generator=gen)))
        for e in range(experts):
            for proj, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
                params.append((f"{prefix}.mlp.experts.{e}.{proj}.weight", torch.randn(*shape, generator=gen)))
    return [(n, t.to(torch.bfloat16)) for n, t in params]


def plan(params, bucket_mb: int) -> list[tuple[list[str], torch.dtype, list[list[int]]]]:
    return [(b.names, b.dtype, b.shapes) for b in buckets(params, bucket_mb * 2**20)]


def send_flattened(group, params, bucket_mb: int) -> None:
    """Packs bucket k+1 while bucket k is on the wire (at most two buckets alive)."""
    stream = buckets(params, bucket_mb * 2**20)
    current = next(stream, None)
    while current is not None:
        sender = threading.Thread(target=broadcast, args=(group, current.buffer))
        sender.start()
        upcoming = next(stream, None)
        sender.join()
        current = upcoming


def receiver(rank: int, world: int, port: int, repeats: int) -> None:
    torch.set_num_threads(1)
    params = moe_parameters()
    model = {n: torch.empty_like(t) for n, t in params}
    group = open_group("127.0.0.1", port, rank, world, "bench", "gloo")
    total = sum(t.numel() * t.element_size() for _, t in params)
    bucket_plans = {mb: plan(params, mb) for mb in BUCKET_MB}
    for bucket_mb in BUCKET_MB:
        for _ in range(repeats):
            phase(
                group,
                lambda mb=bucket_mb: [
                    model[name].copy_(view)
                    for names, dtype, shapes in bucket_plans[mb]
                    for name, view in zip(names, receive_bucket(group, [dtype] * len(names), shapes, None))
                ],
            )
            phase(group, lambda: broadcast(group, torch.empty(total, dtype=torch.uint8)))
            phase(
                group,
                lambda: [
                    model[name].copy_(tensor)
                    for (name, _), tensor in zip(
                        params, receive_tensors(group, [t.dtype for _, t in params], [list(t.shape) for _, t in params])
                    )
                ],
            )


def phase(group, work) -> float:
    """Runs one measured phase between two barriers; returns its wall time."""
    group.barrier().wait()
    start = time.perf_counter()
    work()
    group.barrier().wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = moe_parameters()
    total = sum(t.numel() * t.element_size() for _, t in params)
    world, port = 1 + args.engines, free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receiver, args=(r, world, port, args.repeats)) for r in range(1, world)]
    for proc in procs:
        proc.start()
    group = open_group("127.0.0.1", port, 0, world, "bench", "gloo")
    rows = []
    for bucket_mb in BUCKET_MB:
        times = {"flattened": [], "single": [], "per_tensor": []}
        blob = torch.empty(total, dtype=torch.uint8)
        for _ in range(args.repeats):
            times["flattened"].append(phase(group, lambda mb=bucket_mb: send_flattened(group, params, mb)))
            times["single"].append(phase(group, lambda blob=blob: broadcast(group, blob)))
            times["per_tensor"].append(phase(group, lambda: [broadcast(group, t) for _, t in params]))
        rows.append((bucket_mb, *(statistics.median(times[k]) for k in ("flattened", "single", "per_tensor"))))
    for proc in procs:
        proc.join()
    print(
        f"{len(params)} tensors, {total / 2**20:.0f} MiB bf16, 1 learner → {args.engines} engine processes, "
        f"gloo on loopback, median of {args.repeats}"
    )
    print(
        f"{'bucket MiB':>10} {'(a) flat s':>11} {'(b) wire s':>11} {'(c) per-tensor s':>17} {'(b)/(a)':>8} {'(c)/(a)':>8}"
    )
    for bucket_mb, flat, single, per_tensor in rows:
        print(
            f"{bucket_mb:>10} {flat:>11.3f} {single:>11.3f} {per_tensor:>17.3f} {single / flat:>8.2f} "
            f"{per_tensor / flat:>8.2f}"
        )
    best = min(rows, key=lambda r: r[1])
    print(f"best bucket size {best[0]} MiB: (c)/(a) = {best[3] / best[1]:.2f}")
    print(f"ratio: {best[2] / best[1]:.2f}")


if __name__ == "__main__":
    main()
