"""What a comparison leaves behind in --out: table.csv and table.md (mean and last-window value
of every metric per run, seeds as mean ± std), one PNG per metric with every run overlaid
(plots/), and report.md / report.html, which say per algorithm, off-policy degree and --vary
variant which replay mode was most stable and why, in numbers, and put every combination's
stability numbers side by side. Markdown and HTML are rendered from the same blocks, so the
two never disagree."""

from __future__ import annotations

import csv
import html
import re
import statistics
from pathlib import Path

from megatron_rlvr.compare import analysis as an

MODE_COLORS = {"none": "tab:red", "r2": "tab:orange", "r3": "tab:green"}
DEGREE_STYLES = ("-", "--", ":", "-.")
MARKERS = (None, "o", "s", "^", "v", "D", "x", "+")
LOG_SCALE = {"train/approx_kl", an.MISMATCH, "train/mismatch_abs_mean", "train/mismatch_abs_max", "train/grad_norm"}


def fmt(value: float, digits: int = 4) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.{digits}g}"
    return f"{value:.{min(digits - 1, 2)}e}"


def fmt_pm(mean: float, std: float, seeds: int) -> str:
    return fmt(mean) if seeds < 2 else f"{fmt(mean)} ± {fmt(std)}"


def seeds_pm(values: list[float]) -> str:
    """Per-seed values as 'mean ± std' to three decimals (the benchmarks' README tables), '–' for none."""
    if not values:
        return "–"
    std = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{std}"


def slug(key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def group_title(combo: an.Combo) -> str:
    """`grpo, 4× off-policy` and the variant's settings, if any: what a group's modes share."""
    varied = f", {combo.variant.label}" if combo.variant.settings else ""
    return f"{combo.algo}, {combo.off_policy}× off-policy{varied}"


# ----------------------------------------------------------------------------- the table
def write_table(out: Path, table: dict[an.Combo, dict[str, an.Cell]], keys: list[tuple[str, str]], seeds: int) -> None:
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["algo", "off_policy", "variant", "mode", "seeds", "metric", "mean", "mean_std", "last", "last_std"]
        )
        for combo, cells in table.items():
            for key, _ in keys:
                if key in cells:
                    c = cells[key]
                    writer.writerow(
                        [
                            combo.algo,
                            combo.off_policy,
                            combo.variant.label,
                            combo.mode,
                            seeds,
                            key,
                            c.mean[0],
                            c.mean[1],
                            c.last[0],
                            c.last[1],
                        ]
                    )
    (out / "table.md").write_text(to_markdown(table_blocks(table, keys, seeds)))


def table_blocks(table: dict[an.Combo, dict[str, an.Cell]], keys: list[tuple[str, str]], seeds: int) -> list:
    """One table per algorithm, off-policy degree and variant: metrics down, modes across; each
    cell 'mean over the run / last window'."""
    blocks: list[tuple] = []
    for group in sorted({c.group for c in table}):
        combos = [c for c in table if c.group == group]
        rows = []
        for key, label in keys:
            if any(key in table[c] for c in combos):
                rows.append(
                    [label]
                    + [
                        f"{fmt_pm(*table[c][key].mean, seeds)} / {fmt_pm(*table[c][key].last, seeds)}"
                        if key in table[c]
                        else "—"
                        for c in combos
                    ]
                )
        blocks.append(("h3", f"{group_title(combos[0])} (mean over the run / last window)"))
        blocks.append(("table", ["metric", *[c.mode for c in combos]], rows))
    return blocks


# ----------------------------------------------------------------------------- plots
def write_plots(out: Path, results: list[an.RunResult], keys: list[tuple[str, str]]) -> list[tuple[str, Path]]:
    """One PNG per metric, every Combo's seed-mean curve overlaid (a band: ± std over seeds).
    Colour tells the modes apart, or the variants when there are several (the modes then by
    marker); line style the off-policy degree, marker the algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = out / "plots"
    folder.mkdir(exist_ok=True)
    combos = sorted({r.combo for r in results})
    degrees = sorted({c.off_policy for c in combos})
    algos = sorted({c.algo for c in combos})
    modes = sorted({c.mode for c in combos})
    variants = sorted({c.variant for c in combos})
    by_variant = len(variants) > 1
    written = []
    for key, label in keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        positive = True
        for combo in combos:
            steps, mean, std = an.mean_curve(results, combo, key)
            if not steps:
                continue
            positive = positive and min(mean) > 0
            style = DEGREE_STYLES[degrees.index(combo.off_policy) % len(DEGREE_STYLES)]
            shape = (
                algos.index(combo.algo) * len(modes) + modes.index(combo.mode)
                if by_variant
                else algos.index(combo.algo)
            )
            marker = MARKERS[shape % len(MARKERS)]
            color = f"C{variants.index(combo.variant) % 10}" if by_variant else MODE_COLORS.get(combo.mode)
            width = max(2.4 - 0.6 * modes.index(combo.mode), 0.8)  # identical curves stay visible
            (line,) = ax.plot(
                steps,
                mean,
                style,
                marker=marker,
                markersize=3,
                linewidth=width,
                color=color,
                label=combo.label(),
            )
            if any(std):
                ax.fill_between(
                    steps,
                    [m - s for m, s in zip(mean, std)],
                    [m + s for m, s in zip(mean, std)],
                    color=line.get_color(),
                    alpha=0.15,
                )
        if key in LOG_SCALE and positive:
            ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = folder / f"{slug(key)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append((label, path))
    return written


# ----------------------------------------------------------------------------- the verdict
def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def verdict(candidates: list[an.Stability], steps: int) -> str:
    """One paragraph: which mode was most stable at this algorithm, off-policy degree and
    variant, and the numbers that say why."""
    best = an.most_stable(candidates)
    c = best.combo

    def trend(s: an.Stability) -> str:
        return (
            f"{s.combo.mode}'s mismatch KL went {s.mismatch_first:.1e} → {s.mismatch_last:.1e} "
            f"({s.growth:.1f}×, peak {s.mismatch_peak:.1e})"
        )

    others = [s for s in candidates if s is not best]
    varied = f", {c.variant.label}" if c.variant.settings else ""
    text = f"At {c.off_policy}× off-policy ({c.algo}{varied}), "
    if others:
        text += (
            f"**{c.mode}** was most stable: over {steps} steps {trend(best)}, while {', '.join(map(trend, others))}."
        )
    else:
        text += f"only {c.mode} ran: over {steps} steps {trend(best)}."
    troubled = [s for s in candidates if s.disqualified]
    for s in troubled:
        what = []
        if s.collapses:
            what.append(
                f"reward collapsed in {s.collapses} seed(s) ({fmt(s.reward_first, 2)} → {fmt(s.reward_last, 2)})"
            )
        if s.spikes:
            what.append(f"{s.spikes} grad-norm spike(s), up to {s.spike_ratio:.0f}× its median")
        text += f" {s.combo.mode}: {' and '.join(what)}."
    if not troubled:
        text += " No run had a reward collapse or a grad-norm spike."
    elif best.disqualified and others:
        text += " Every run was disqualified, so the lowest mismatch decided."
    text += (
        " Reward, first → last window: "
        + "; ".join(f"{s.combo.mode} {fmt(s.reward_first, 2)} → {fmt(s.reward_last, 2)}" for s in candidates)
        + "."
    )
    agreements = [s for s in candidates if s.natural_agreement is not None]
    if agreements:
        text += (
            " Learner/engine routing agreement, natural vs used: "
            + "; ".join(f"{s.combo.mode} {_pct(s.natural_agreement)} vs {_pct(s.used_agreement)}" for s in agreements)
            + "."
        )
    return text


def side_by_side(stabilities: list[an.Stability], seeds: int) -> tuple:
    """One row per combination with the numbers the rule reads, in the groups' order, so that
    variants (a correction, a baseline) compare across groups, not only the modes within one."""
    rows = [
        [
            s.combo.label(),
            f"{fmt(s.reward_first, 2)} → {fmt(s.reward_last, 2)}",
            f"{s.collapses} of {seeds}",
            f"{s.spikes} (up to {s.spike_ratio:.0f}×)" if s.spikes else "0",
            f"{s.mismatch_last:.1e}",
            _pct(s.natural_agreement),
        ]
        for s in sorted(stabilities, key=lambda s: (s.combo.group, s.combo.mode))
    ]
    head = [
        "combination",
        "reward, first → last window",
        "reward collapsed (seeds)",
        "grad-norm spikes",
        "mismatch KL, last window",
        "routing agreement with engine",
    ]
    return ("table", head, rows)


RULE = (
    f"Rule: a run is disqualified if its last-window reward is more than {an.COLLAPSE} below its "
    f"best window (reward collapse) or, after the first window, any step's grad norm exceeds "
    f"{an.SPIKE:g}× the run's median (grad-norm spike; the first steps from random weights are atypical "
    "everywhere). Of the remaining runs (all, if none remains), the most stable has the lowest "
    "last-window mismatch KL, the k3 estimate of KL(rollout ‖ learner) on the sampled tokens. "
    "Windows are the first and last fifth of the steps; seeds are averaged."
)


# ----------------------------------------------------------------------------- rendering
def to_markdown(blocks: list) -> str:
    lines = []
    for kind, *body in blocks:
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + body[0], ""]
        elif kind == "p":
            lines += [body[0], ""]
        elif kind == "table":
            head, rows = body
            cells = [[cell.replace("|", "\\|") for cell in row] for row in [head, *rows]]
            lines.append("| " + " | ".join(cells[0]) + " |")
            lines.append("|" + "---|" * len(head))
            lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
            lines.append("")
        elif kind == "img":
            lines += [f"![{body[0]}]({body[1]})", ""]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text, quote=False))


def to_html(blocks: list, title: str) -> str:
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em}"
        "td:not(:first-child){text-align:right}img{max-width:48%}</style></head><body>",
    ]
    for kind, *body in blocks:
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{_inline_html(body[0])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline_html(body[0])}</p>")
        elif kind == "table":
            head, rows = body
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
            parts.append("</table>")
        elif kind == "img":
            parts.append(f"<img src='{html.escape(body[1])}' alt='{html.escape(body[0])}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: Path, results: list[an.RunResult], setup: list[str], steps: int, seeds: int) -> list[str]:
    """Writes the table, the plots and report.md/.html; returns the verdict paragraphs."""
    window = an.window_size(steps)
    keys = an.metric_keys(results)
    for r in results:
        an.summarise(r, [k for k, _ in keys], window)
    table = an.aggregate(results, [k for k, _ in keys])
    write_table(out, table, keys, seeds)
    plots = write_plots(out, results, keys)
    stabilities = [an.stability(results, c, window) for c in table]
    verdicts = [
        verdict([s for s in stabilities if s.combo.group == group], steps) for group in sorted({c.group for c in table})
    ]
    blocks = [
        ("h1", "Routing replay comparison"),
        *[("p", line) for line in setup],
        ("h2", "Which mode kept training stable"),
        *[("p", v) for v in verdicts],
        ("p", RULE),
        ("h2", "Every combination side by side"),
        side_by_side(stabilities, seeds),
        ("h2", "Metrics"),
        *table_blocks(table, keys, seeds),
        ("h2", "Curves"),
        *[("img", label, str(path.relative_to(out))) for label, path in plots],
    ]
    (out / "report.md").write_text(to_markdown(blocks))
    (out / "report.html").write_text(to_html(blocks, "Routing replay comparison"))
    return verdicts
