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
from megatron_rlvr.compare import verdict as vd

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


def _kl(values: list[float]) -> str:
    if not values:
        return "missing"
    std = f" ± {statistics.stdev(values):.1e}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.1e}{std}"


def _value(m: vd.ModeNumbers, c: vd.Criterion) -> str:
    """A criterion over a mode's seeds, mean ± std in its unit; 'missing' where no run logged it."""
    values = m.values[c.key]
    if not values:
        return "missing"
    if c.counted:
        return f"{m.flagged(c)} of {len(values)}"
    std = f" ± {c.show(statistics.stdev(values))}" if len(values) > 1 else ""
    return f"{c.show(statistics.fmean(values))}{std}"


def _flagged(m: vd.ModeNumbers, c: vd.Criterion) -> str:
    if c.counted or not m.values[c.key]:
        return _value(m, c)
    return f"{_value(m, c)} ({m.flagged(c)} of {len(m.values[c.key])})"


def _share(values: list[float]) -> str:
    if not values:
        return "missing"
    std = f" ± {statistics.stdev(values):.0%}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.0%}{std}"


def _versus(a: vd.ModeNumbers, b: vd.ModeNumbers, c: vd.Criterion) -> str:
    return f"{c.label} {a.combo.mode} {_value(a, c)} vs {b.combo.mode} {_value(b, c)}"


def _seeds(modes: list[vd.ModeNumbers]) -> str:
    counts = {m.seeds for m in modes}
    if len(counts) == 1:
        n = counts.pop()
        return f"{n} seed{'s' if n > 1 else ''} per mode"
    return "seeds " + ", ".join(f"{m.combo.mode} {m.seeds}" for m in modes)


def _comparisons(v: vd.Verdict) -> str:
    """What the pairs of modes show, for a verdict without a most stable mode."""
    said = []
    for p in v.pairs:
        better = p.more_stable()
        if better is not None:
            other = p.other(better)
            said.append(
                f"{better.combo.mode} was more stable than {other.combo.mode} ("
                + ", ".join(_versus(better, other, c) for c in p.lower(better))
                + ")"
            )
        elif p.lower(p.a) and p.lower(p.b):
            said.append(
                f"{p.a.combo.mode} and {p.b.combo.mode} differ both ways ("
                + ", ".join(_versus(p.a, p.b, c) for c in p.lower(p.a) + p.lower(p.b))
                + ")"
            )
    if said:
        text = "; ".join(said) + "; no mode was more stable than every other"
    else:
        r, g, e = (c.label for c in vd.CRITERIA)
        text = f"no mode's {r}, {g} or {e} differs from another's beyond the spread of {_seeds(v.modes)}"
    closest = v.closest()
    if closest is None:
        floors = ", ".join(f"{c.label} {c.show(c.floor)}" for c in vd.CRITERIA if not c.counted)
        rest = "The other differences are" if said else "Every difference is"
        return f"{text}. {rest} within the rule's floors ({floors}) or missing on one side: more seeds would not make one count."
    pair, c = closest
    seeds = pair.gaps[c.key].seeds or 0
    needed = f"more than {vd.MAX_SEEDS:,}" if seeds > vd.MAX_SEEDS else f"about {seeds}"
    return (
        f"{text}. The closest difference, {_versus(pair.a, pair.b, c)}, would take {needed} seeds per mode "
        "to resolve at this spread."
    )


def verdict(v: vd.Verdict) -> str:
    """One paragraph: which mode, if any, was most stable at this algorithm, off-policy degree and
    variant, the numbers that say why, and the mismatch KL beside them (never ranked)."""
    c = v.modes[0].combo
    varied = f", {c.variant.label}" if c.variant.settings else ""
    text = f"At {c.off_policy}× off-policy ({c.algo}{varied}), "
    if v.winner is not None:
        w = v.winner
        text += (
            f"**{w.combo.mode}** was most stable, beyond the spread of {_seeds(v.modes)}: "
            + "; ".join(
                f"against {p.other(w).combo.mode}, " + ", ".join(_versus(w, p.other(w), crit) for crit in p.lower(w))
                for p in v.pairs
                if w in (p.a, p.b)
            )
            + "."
        )
    elif len(v.modes) < 2:
        text += f"only {c.mode} ran ({_seeds(v.modes)}): there is nothing to compare it with."
    else:
        text += "**no difference shown at this scale**: "
        text += ("; ".join(v.blockers) + ".") if v.blockers else _comparisons(v)
    if vd.judgeable(v.steps):
        text += (
            f" Over {_seeds(v.modes)}, mean ± std (runs flagged): "
            + "; ".join(
                f"{crit.label} " + ", ".join(f"{m.combo.mode} {_flagged(m, crit)}" for m in v.modes)
                for crit in vd.CRITERIA
            )
            + " (entropy kept, last window over first: "
            + ", ".join(f"{m.combo.mode} {_share(m.entropy_left)}" for m in v.modes)
            + ")."
        )
    text += (
        f" Reward, first → last {v.window}-step window: "
        + "; ".join(f"{m.combo.mode} {seeds_pm(m.reward_first)} → {seeds_pm(m.reward_last)}" for m in v.modes)
        + ". Mismatch KL, last window (shown, not ranked: R3 lowers it by construction): "
        + "; ".join(f"{m.combo.mode} {_kl(m.mismatch_last)}" for m in v.modes)
        + "."
    )
    agreements = [m for m in v.modes if m.natural_agreement is not None]
    if agreements:
        text += (
            " Learner/engine routing agreement, natural vs used: "
            + "; ".join(f"{m.combo.mode} {_pct(m.natural_agreement)} vs {_pct(m.used_agreement)}" for m in agreements)
            + "."
        )
    return text


def side_by_side(modes: list[vd.ModeNumbers]) -> tuple:
    """One row per combination with the numbers the rule reads, in the groups' order, so that
    variants (a correction, a baseline) compare across groups, not only the modes within one."""
    rows = [
        [
            m.combo.label(),
            str(m.seeds),
            f"{seeds_pm(m.reward_first)} → {seeds_pm(m.reward_last)}",
            *[_flagged(m, c) for c in vd.CRITERIA],
            _share(m.entropy_left),
            _kl(m.mismatch_last),
            _pct(m.natural_agreement),
        ]
        for m in sorted(modes, key=lambda m: (m.combo.group, m.combo.mode))
    ]
    head = [
        "combination",
        "seeds",
        "reward, first → last window",
        *[f"{c.label} (runs)" if c.counted else f"{c.label} (runs with a {c.flag})" for c in vd.CRITERIA],
        "entropy kept, last window over first",
        "mismatch KL, last window (not ranked)",
        "routing agreement with engine",
    ]
    return ("table", head, rows)


def rule(steps: int) -> str:
    window = an.window_size(steps)
    r, g, e = vd.CRITERIA
    return (
        "Rule: stability is judged by what routing replay does not lower by construction: the reward drop "
        f"(the best window's mean reward minus the last window's; a collapse above {r.show(r.limit)}), the "
        "grad-norm peak (the largest grad norm after the first window over the run's median; a spike above "
        f"{g.show(g.limit)}) and entropy collapse (the last window keeping less than {vd.ENTROPY_KEPT:.0%} of "
        "the first window's policy entropy; a policy that learns loses entropy, so only a collapse counts). "
        "A mode is more stable than another when one of these, averaged over seeds, is lower by more than "
        f"its floor ({r.show(r.floor)}, {g.show(g.floor)}) and by more than Student's t (95%) times the "
        "standard error of the difference, and none is higher by as much; the most stable mode is more "
        "stable than every other. That takes two seeds per mode at least (--seeds). The mismatch KL (k3 "
        "estimate of KL(rollout ‖ learner)) is shown beside them and ranks nothing: R3 lowers it by "
        f"construction. Windows here are {window} steps (a fifth of the run, {an.MIN_WINDOW} at least; a "
        "run shorter than two windows is not judged); a metric a run did not log is shown as missing."
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
    modes = [vd.mode_numbers([r for r in results if r.combo == c], window) for c in table]
    judged = [vd.judge([m for m in modes if m.combo.group == g], steps) for g in sorted({c.group for c in table})]
    verdicts = [verdict(v) for v in judged]
    blocks = [
        ("h1", "Routing replay comparison"),
        *[("p", line) for line in setup],
        ("h2", "Which mode kept training stable"),
        *[("p", v) for v in verdicts],
        ("p", rule(steps)),
        ("h2", "Every combination side by side"),
        side_by_side(modes),
        ("h2", "Metrics"),
        *table_blocks(table, keys, seeds),
        ("h2", "Curves"),
        *[("img", label, str(path.relative_to(out))) for label, path in plots],
    ]
    (out / "report.md").write_text(to_markdown(blocks))
    (out / "report.html").write_text(to_html(blocks, "Routing replay comparison"))
    return verdicts
