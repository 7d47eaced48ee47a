"""The built-in tool task: multi-digit products and sums that a tiny model cannot compute, but
can answer by calling the `calculator` tool with the problem's expression and copying its
result into GSM8K's `#### N`, which the math verifier reads:

    user       "472*386="
    assistant  tool call calculator(expression="472*386")
    tool       "182192"
    assistant  "#### 182192"

worked_traces() writes such conversations for the supervised cold start (OpenAI message layout:
`tool_calls` on the assistant turn, a `tool` turn with the result), a share of them with one
slip (slip_rate): a digit of the expression written wrong (the tool then computes the wrong
problem and the answer copies its result) or a digit of the result copied wrong. Imitating them
leaves the cold start right only sometimes: room for RL. direct_traces() are the baseline's
cold start without the tool: the right answer written at once.

Problems are split by a hash of the problem, whatever the seed: held out (an eighth), and the
two halves of the rest, one for the cold start's traces (train_sft) and one for RL (train_rl).

    python -m megatron_rlvr.data.tool_arithmetic OUT_DIR [key=value ...]   # writes the demo's files
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

DATA_SOURCE = "tool_arithmetic"
TOOL = "calculator"
Split = Literal["train_sft", "train_rl", "heldout"]
SPLITS: tuple[Split, ...] = ("train_sft", "train_rl", "heldout")


@dataclass(frozen=True)
class ToolArithmetic:
    """The task's settings: operands of min_digits..max_digits digits, products with
    probability product_share (else sums); slip_rate of the cold-start traces have one slip."""

    min_digits: int = 2
    max_digits: int = 3
    product_share: float = 0.75
    slip_rate: float = 0.75
    train_prompts: int = 4096
    sft_traces: int = 4096
    heldout_prompts: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"digits {self.min_digits}..{self.max_digits}: need 1 <= min_digits <= max_digits <= 9")
        for name in ("product_share", "slip_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be in [0, 1]")
        for name in ("train_prompts", "sft_traces", "heldout_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")


def problem_split(question: str) -> Split:
    """heldout for an eighth of all problems, else train_sft or train_rl (another hash): the same
    whatever the seed, so no set ever shares a problem with another."""
    if zlib.crc32(question.encode()) % 8 == 0:
        return "heldout"
    return "train_rl" if zlib.crc32(f"rl:{question}".encode()) % 2 else "train_sft"


def evaluate(expression: str) -> int:
    """The value of a task expression (`a*b` or `a+b`, non-negative integers), as the calculator
    returns it; a slip's expression is of the same form."""
    for op in "*+":
        left, found, right = expression.partition(op)
        if found:
            a, b = int(left), int(right)
            return a * b if op == "*" else a + b
    raise ValueError(f"not a task expression: {expression!r}")


def draw_problems(task: ToolArithmetic, split: Split, count: int, seed: int) -> list[str]:
    """count distinct expressions of split, drawn with seed."""
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[str] = []
    for _ in range(count * 100):
        if len(problems) == count:
            return problems
        op = "*" if rng.random() < task.product_share else "+"
        a, b = (rng.randrange(10 ** (d - 1), 10**d) for d in _digits(rng, task, 2))
        expression = f"{a}{op}{b}"
        if expression not in seen and problem_split(expression) == split:
            seen.add(expression)
            problems.append(expression)
    raise ValueError(
        f"only {len(problems)} distinct {split} problems of {count} in {count * 100} draws: widen the digits"
    )


def _digits(rng: random.Random, task: ToolArithmetic, n: int) -> list[int]:
    return [rng.randint(task.min_digits, task.max_digits) for _ in range(n)]


def question(expression: str) -> str:
    return f"{expression}="


def prompt_row(index: int, expression: str, split: Split) -> dict[str, Any]:
    """One RL or eval prompt in the plain file layout (data.type file, format plain)."""
    return {
        "id": f"{split}-{index}",
        "prompt": [{"role": "user", "content": question(expression)}],
        "answer": str(evaluate(expression)),
        "verifier": "math",
        "data_source": DATA_SOURCE,
    }


def tool_call(expression: str) -> dict[str, Any]:
    """An assistant tool call to the calculator in OpenAI's message layout."""
    return {"type": "function", "function": {"name": TOOL, "arguments": {"expression": expression}}}


def worked_trace(expression: str, rng: random.Random, slip_rate: float) -> list[dict[str, Any]]:
    """The conversation that answers expression with the calculator; with probability slip_rate
    one slip, half of them in the expression written, half in the result copied."""
    written, copy_slip = expression, False
    if rng.random() < slip_rate:
        if rng.random() < 0.5:
            written = _slip_digit(expression, rng)
        else:
            copy_slip = True
    result = str(evaluate(written))
    answer = _slip_digit(result, rng) if copy_slip else result
    return [
        {"role": "user", "content": question(expression)},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(written)]},
        {"role": "tool", "name": TOOL, "content": result},
        {"role": "assistant", "content": f"#### {answer}"},
    ]


def direct_trace(expression: str) -> list[dict[str, Any]]:
    """The baseline's conversation: the right answer at once, no tool."""
    return [
        {"role": "user", "content": question(expression)},
        {"role": "assistant", "content": f"#### {evaluate(expression)}"},
    ]


def _slip_digit(text: str, rng: random.Random) -> str:
    """text with one digit replaced by another (never a leading digit by 0)."""
    positions = [i for i, ch in enumerate(text) if ch.isdigit()]
    i = rng.choice(positions)
    leading = i == 0 or not text[i - 1].isdigit()
    choices = [d for d in "0123456789" if d != text[i] and not (leading and d == "0" and len(text) > i + 1)]
    return text[:i] + rng.choice(choices) + text[i + 1 :]


def worked_traces(task: ToolArithmetic) -> list[list[dict[str, Any]]]:
    """The cold start's conversations, on train_sft problems."""
    rng = random.Random(task.seed + 2)
    return [worked_trace(e, rng, task.slip_rate) for e in draw_problems(task, "train_sft", task.sft_traces, task.seed)]


def direct_traces(task: ToolArithmetic) -> list[list[dict[str, Any]]]:
    """The baseline cold start's conversations, on the same problems as worked_traces'."""
    return [direct_trace(e) for e in draw_problems(task, "train_sft", task.sft_traces, task.seed)]


FILES = {
    "train": "train.jsonl",  # RL prompts (train_rl)
    "heldout": "heldout.jsonl",  # eval prompts
    "sft": "sft.jsonl",  # worked tool traces (train_sft), sft.data format messages
    "sft_direct": "sft-direct.jsonl",  # the no-tool baseline's traces, the same problems
}


def write_files(task: ToolArithmetic, out_dir: str | Path) -> dict[str, Path]:
    """The demo's four files in out_dir (made if missing); the same bytes for the same settings."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = draw_problems(task, "train_rl", task.train_prompts, task.seed + 1)
    heldout = draw_problems(task, "heldout", task.heldout_prompts, task.seed + 3)
    rows = {
        "train": [prompt_row(i, e, "train_rl") for i, e in enumerate(train)],
        "heldout": [prompt_row(i, e, "heldout") for i, e in enumerate(heldout)],
        "sft": [{"messages": m} for m in worked_traces(task)],
        "sft_direct": [{"messages": m} for m in direct_traces(task)],
    }
    paths = {}
    for key, name in FILES.items():
        paths[key] = out / name
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows[key])
        paths[key].write_text(text, encoding="utf-8")
    return paths


def parse_settings(argv: list[str]) -> ToolArithmetic:
    """key=value arguments as the task's settings; a one-line SystemExit for a bad one."""
    known = {f.name: f.type for f in fields(ToolArithmetic)}
    settings: dict[str, Any] = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in known:
            raise SystemExit(f"tool_arithmetic: {arg!r} is not key=value with a key of {', '.join(known)}")
        try:
            settings[key] = float(value) if key in ("product_share", "slip_rate") else int(value)
        except ValueError:
            raise SystemExit(f"tool_arithmetic: {key} = {value!r} is not a number") from None
    try:
        return ToolArithmetic(**settings)
    except ValueError as err:
        raise SystemExit(f"tool_arithmetic: {err}") from None


def main(argv: list[str]) -> int:
    if not argv or "=" in argv[0]:
        raise SystemExit("usage: python -m megatron_rlvr.data.tool_arithmetic OUT_DIR [key=value ...]")
    task = parse_settings(argv[1:])
    for key, path in write_files(task, argv[0]).items():
        count = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"{key:>10}: {path} ({count} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
