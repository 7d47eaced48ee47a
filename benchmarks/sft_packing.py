"""The supervised step of the long-answer cold start (configs/long-answers-sft-cpu.yaml: its model,
its odd-count worked solutions, 1024-token steps) in four layouts, on one learner, contenders
taking turns step by step (each goes first in turn) so machine noise hits all alike; medians:

    padded-1024  rows padded to the longest of their micro-batch, micro-batches of at most 1024
                 padded tokens (rows longest first), sft.pack_sequences=false: several a step
    padded-one   every row of a step in one micro-batch, padded to the step's longest: as many
                 micro-batches as packed-256 (the micro-batches column says how many each takes)
    packed-1024  one row of up to 1024 tokens a micro-batch, conversations back to back under a
                 block-diagonal causal mask (row_tokens = micro_batch_tokens)
    packed-256   rows of up to 256 tokens (sft.max_tokens), as many as a step needs in one
                 micro-batch (micro_batch_tokens 2048): the cold start's layout

Each step is a real update (the learner trains on as it is timed); tokens/s counts the
conversations' own tokens; speed-up is against padded-1024 and, in the last column, against
padded-one. World size 1, CPU, threads as torch sets them (both cores).

    .venv/bin/python benchmarks/sft_packing.py --steps 20   # docs/batching.md: ~2 minutes on 2 cores, alone
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from megatron_rlvr.config import load_config
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import Rendezvous, free_port, init_parallel
from megatron_rlvr.run import prepare_model
from megatron_rlvr.sft import data as sft_data

REPO = Path(__file__).resolve().parents[1]
STEP_TOKENS = 1024
ONE_MICRO_BATCH = 1 << 30  # a budget no step reaches: all its rows in one micro-batch
LAYOUTS = {  # name: (micro_batch_tokens, packed, row_tokens)
    "padded-1024": (1024, False, None),
    "padded-one": (ONE_MICRO_BATCH, False, None),
    "packed-1024": (1024, True, None),
    "packed-256": (2048, True, 256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    args = parser.parse_args()
    cfg = load_config(
        REPO / "configs" / "long-answers-sft-cpu.yaml",
        ["sft.data.num_prompts=3000", f"trainer.output_dir={tempfile.mkdtemp()}"],
    )
    assert cfg.sft is not None
    hf_dir, tokenizer = prepare_model(cfg)  # the demo's tiny model, created as the sft command creates it
    init_parallel(cfg.parallel, Rendezvous(rank=0, world_size=1, master_port=free_port()))
    learner = Learner(cfg, str(hf_dir))
    renderer = sft_data.ConversationRenderer(tokenizer, cfg.data)
    examples = [renderer.example(c) for c in sft_data.load_conversations(cfg.sft, cfg.trainer.seed)]
    steps = sft_data.step_batches(examples, STEP_TOKENS, args.steps + 2, cfg.trainer.seed)
    pad = tokenizer.pad_token_id
    timings: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    cost: dict[str, list[float]] = {name: [] for name in LAYOUTS}  # positions run / real tokens
    micros: dict[str, list[int]] = {name: [] for name in LAYOUTS}  # micro-batches a step
    for i, batch in enumerate(steps):
        names = list(LAYOUTS)[i % len(LAYOUTS) :] + list(LAYOUTS)[: i % len(LAYOUTS)]
        for name in names:
            micro_tokens, packed, row_tokens = LAYOUTS[name]
            micro = sft_data.pack_micro_batches(batch, micro_tokens, pad, packed, row_tokens=row_tokens)
            start = time.perf_counter()
            learner.sft_step(micro)
            if i >= 2:  # the first steps allocate
                timings[name].append(time.perf_counter() - start)
                cost[name].append(sum(mb.input_ids.numel() for mb in micro) / sum(len(e) for e in batch))
                micros[name].append(len(micro))
    tokens = statistics.fmean(sum(len(e) for e in batch) for batch in steps[2:])
    base, alike = statistics.median(timings["padded-1024"]), statistics.median(timings["padded-one"])
    print(f"the long-answer cold start's SFT step: {STEP_TOKENS}-token steps, {args.steps} steps a layout, world 1")
    print(
        f"{'layout':>12} {'s/step':>7} {'tok/s':>6} {'micro-batches':>13} {'positions/token':>15} "
        f"{'vs padded-1024':>14} {'vs padded-one':>14}"
    )
    for name, t in timings.items():
        median = statistics.median(t)
        print(
            f"{name:>12} {median:>7.3f} {tokens / median:>6.0f} {statistics.fmean(micros[name]):>13.1f} "
            f"{statistics.fmean(cost[name]):>15.2f} {base / median:>14.2f} {alike / median:>14.2f}"
        )


if __name__ == "__main__":
    main()
