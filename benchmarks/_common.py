"""What the learner benchmarks share: their command line and the local single-rank world."""

from __future__ import annotations

import argparse

import torch


def step_benchmark_args(description: str, *, length: bool = True) -> argparse.Namespace:
    """--steps and --batch, and --length where the benchmark's sequence length is a free choice
    (length=False: the batches' lengths come from the benchmark's task)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    if length:
        parser.add_argument("--length", type=int, default=48, help="tokens per sequence")
    args = parser.parse_args()
    torch.set_num_threads(1)  # both contenders on one core: the machine has two, and noise
    return args
