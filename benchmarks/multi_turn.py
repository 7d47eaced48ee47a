"""Multi-turn rollout throughput with slow tools: the tool demo's episodes (a held-out problem,
a calculator call, its result, the answer; megatron_rlvr/data/tool_arithmetic.py) on the CPU
engine, with a calculator that takes 0, 100 or 500 ms a call (a blocking sleep, as a remote
API or a sandbox start is), run concurrently (a tool pool of as many workers as episodes in
flight) against one at a time (one worker).

Per delay and pool: rollout tokens/s (tokens the model sampled over the wall time of all the
episodes; tool turns are not counted), the engine's busy fraction (the share of that time at
least one generation request was outstanding), tool calls and turns per episode, and the mean
seconds a call took. Episodes run at most --concurrency at once, each turn one /generate, as
the training loop runs a batch of groups; the learner is not in the loop, so the numbers are
the rollout's own. The last line is `ratio: X`: concurrent tools at the largest delay over
instant tools (the goal: >= 0.8).

The model is the tool demo's cold start (`megatron-rlvr sft configs/tool-calculator-sft-cpu.yaml`
writes runs/tool-calculator-sft/hf; its data first: `python -m megatron_rlvr.data.tool_arithmetic
runs/tool-calculator-data`); --model takes any checkpoint that writes hermes tool calls.

    .venv/bin/python benchmarks/multi_turn.py [--model DIR] [--episodes 64] [--concurrency 32] [--delays 0 0.1 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from megatron_rlvr.agent.episode import Episode, EpisodeSettings
from megatron_rlvr.agent.parsers import parse_hermes
from megatron_rlvr.agent.render import TurnRenderer
from megatron_rlvr.agent.tools import FunctionTool, ToolPool, calculator
from megatron_rlvr.config import CpuEngine
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.launcher import engine_process

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "runs" / "tool-calculator-sft" / "hf"
DATA = REPO / "runs" / "tool-calculator-data" / "heldout.jsonl"
TEMPLATE = REPO / "configs" / "tool-calculator.jinja"
POOLS = ("concurrent", "one at a time")


def slow_calculator(delay_s: float) -> FunctionTool:
    """The shipped calculator, delay_s slower a call (blocking its worker thread meanwhile)."""

    def calc(expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: the expression, e.g. "12*(3+4)"
        """
        time.sleep(delay_s)
        return str(calculator(expression))

    return FunctionTool(calc, name="calculator")


class BusyClock:
    """Wall seconds during which at least one request was outstanding."""

    def __init__(self) -> None:
        self.outstanding, self.busy_s, self.since = 0, 0.0, 0.0

    def start(self) -> None:
        if self.outstanding == 0:
            self.since = time.monotonic()
        self.outstanding += 1

    def end(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.busy_s += time.monotonic() - self.since


async def measure(
    client: EngineClient, tokenizer, template: str | None, prompts: list[list[dict]], args, delay_s: float, workers: int
) -> dict:
    """One delay and pool: every prompt's episode, at most args.concurrency at once."""
    pool = ToolPool({"calculator": slow_calculator(delay_s)}, workers=workers, timeout_s=30.0)
    renderer = TurnRenderer(tokenizer, chat_template=template)
    clock = BusyClock()

    async def generate(request: p.GenerateReqInput) -> p.GenerateResponse:
        clock.start()
        try:
            return (await client.generate(request))[0]
        finally:
            clock.end()

    settings = EpisodeSettings(max_turns=args.max_turns)
    sampling = p.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, sampling_seed=args.seed)
    slots = asyncio.Semaphore(args.concurrency)

    async def one(index: int, messages: list[dict]):
        async with slots:
            episode = Episode(
                renderer=renderer,
                parser=parse_hermes,
                pool=pool,
                settings=settings,
                tokenizer=tokenizer,
                generate=generate,
            )
            return await episode.run(messages, sampling, rid=f"b{index}", index=index)

    started = time.monotonic()
    try:
        samples = await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts)))
    finally:
        pool.close()
    wall = time.monotonic() - started
    stats = [s.episode for s in samples if s.episode is not None]
    calls = sum(s.tool_calls for s in stats)
    return {
        "tokens_per_s": sum(s.sampled_tokens() for s in samples) / wall,
        "engine_busy": clock.busy_s / wall,
        "calls_per_episode": calls / len(samples),
        "turns_per_episode": statistics.fmean(s.turns for s in stats),
        "call_s": sum(s.tool_s for s in stats) / max(1, calls),
        "wall_s": wall,
    }


def load_prompts(path: Path, episodes: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        sys.exit(f"multi_turn.py: {path} has no prompts")
    return [rows[i % len(rows)]["prompt"] for i in range(episodes)]


async def run_all(args) -> dict[tuple[float, str], dict]:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    prompts = load_prompts(args.data, args.episodes)
    with tempfile.TemporaryDirectory() as logs:
        engine = engine_process(
            str(args.model), CpuEngine(), host="127.0.0.1", port=free_port(), routed_experts=False, log_dir=logs
        ).start(ready_timeout_s=300)
        client = EngineClient(engine.url)
        try:
            # one untimed round first: the engine's first requests are slower (allocation, caches)
            await measure(client, tokenizer, template, prompts[: args.concurrency], args, 0.0, args.concurrency)
            results = {}
            for delay in args.delays:
                for pool in POOLS:
                    workers = args.concurrency if pool == "concurrent" else 1
                    results[delay, pool] = result = await measure(
                        client, tokenizer, template, prompts, args, delay, workers
                    )
                    print(  # each as it ends, so a cut-short table keeps what was measured
                        f"{delay * 1000:.0f} ms {pool}: {result['tokens_per_s']:.0f} tokens/s, engine busy "
                        f"{result['engine_busy']:.2f}, {result['calls_per_episode']:.2f} calls an episode",
                        flush=True,
                    )
        finally:
            await client.close()
            engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL, help="an HF checkpoint that writes hermes tool calls")
    parser.add_argument("--data", type=Path, default=DATA, help="prompts (plain JSONL layout), cycled")
    parser.add_argument("--chat-template", default=str(TEMPLATE), help="a .jinja file; '' for the model's own")
    parser.add_argument("--episodes", type=int, default=64, help="episodes per delay and pool")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes in flight at once")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.1, 0.5], help="seconds a tool call takes")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=192, help="an episode's token budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        sys.exit(
            f"multi_turn.py: no model at {args.model}: run `megatron-rlvr sft configs/tool-calculator-sft-cpu.yaml` "
            "first (it writes runs/tool-calculator-sft/hf), or pass --model DIR"
        )
    if not args.data.exists():
        sys.exit(
            f"multi_turn.py: no prompts at {args.data}: run `python -m megatron_rlvr.data.tool_arithmetic {DATA.parent}`"
        )
    results = asyncio.run(run_all(args))
    print("\n| tool call | tools | tokens/s | engine busy | calls/episode | turns/episode | s/call |")
    print("|---|---|---|---|---|---|---|")
    for (delay, pool), r in results.items():
        print(
            f"| {delay * 1000:.0f} ms | {pool} | {r['tokens_per_s']:.0f} | {r['engine_busy']:.2f} | "
            f"{r['calls_per_episode']:.2f} | {r['turns_per_episode']:.2f} | {r['call_s']:.3f} |"
        )
    instant, slowest = min(args.delays), max(args.delays)
    print(
        f"ratio: {results[slowest, 'concurrent']['tokens_per_s'] / results[instant, 'concurrent']['tokens_per_s']:.2f}"
    )


if __name__ == "__main__":
    main()
