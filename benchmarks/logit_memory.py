"""Peak memory of the last stage's logit-side work (logprobs + entropy, forward and backward)
on CPU, and its time: the plain computation the learner used before (Megatron's vocab-parallel cross entropy
on an fp32 copy, entropy through autograd) against learner/logits.py's chunked one. Each runs
in a fresh process; the figure is its peak RSS above the RSS with the logits allocated.

    .venv/bin/python benchmarks/logit_memory.py [--batch 2] [--length 1024] [--vocab 32768]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def plain(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """The learner's computation before chunking (forward.py as of 63f71e5)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import (
        reduce_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )

    shifted = logits[:, :-1].float() / temperature
    logprobs = F.pad(-vocab_parallel_cross_entropy(shifted.contiguous(), ids[:, 1:].contiguous()), (1, 0))
    z = logits[:, :-1].float() / temperature
    peak = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    z = z - peak
    e = z.exp()
    sums = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), (e * z).sum(-1)]))
    return logprobs, F.pad(sums[0].log() - sums[1] / sums[0], (1, 0))


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(kind: str, batch: int, length: int, vocab: int) -> dict:
    from megatron_rlvr.config import load_config
    from megatron_rlvr.learner.logits import logprobs_and_entropy
    from megatron_rlvr.learner.parallel import Rendezvous, free_port, init_parallel

    init_parallel(load_config(None, []).parallel, Rendezvous(rank=0, world_size=1, master_port=free_port()))
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, length, vocab, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    weights = torch.randn(2, batch, length, generator=gen)
    reset_peak()
    base = rss_mib()
    fn = plain if kind == "plain" else logprobs_and_entropy
    started = time.perf_counter()
    lp, h = fn(logits, ids, 0.7)
    ((lp * weights[0]).sum() + (h * weights[1]).sum()).backward()
    seconds = time.perf_counter() - started
    peak = rss_mib("VmHWM")
    return {
        "kind": kind,
        "peak_above_logits_mib": round(peak - base, 1),
        "seconds": round(seconds, 2),
        "logits_mib": round(logits.numel() * 2 / 2**20, 1),
        "lp": lp.detach().double().sum().item(),
        "h": h.detach().double().sum().item(),
        "grad": logits.grad.double().abs().sum().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batch, args.length, args.vocab)))
        return
    results = {}
    for kind in ("plain", "chunked"):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--batch",
                str(args.batch),
                "--length",
                str(args.length),
                "--vocab",
                str(args.vocab),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    plain_peak, chunked_peak = (results[k]["peak_above_logits_mib"] for k in ("plain", "chunked"))
    print(json.dumps(results, indent=1))
    print(
        f"B={args.batch} T={args.length} V={args.vocab} bf16 logits {results['plain']['logits_mib']} MiB: "
        f"peak above the logits {plain_peak} MiB plain, {chunked_peak} MiB chunked "
        f"({plain_peak / max(chunked_peak, 1e-9):.1f}x less); forward+backward "
        f"{results['plain']['seconds']} s plain, {results['chunked']['seconds']} s chunked"
    )


if __name__ == "__main__":
    main()
