"""`compare-replay`'s stability verdict on made-up metrics: a mode is named most stable only when
two seeds per mode at least separate it from every other beyond their spread, by what replay does
not lower by construction (reward collapse, grad-norm spikes, entropy collapse, not the entropy a
learning policy loses); the mismatch KL is shown and never ranks; a missing metric is missing;
windows are several steps."""

import pytest

from megatron_rlvr.compare import analysis as an
from megatron_rlvr.compare import verdict as vd
from megatron_rlvr.compare.report import verdict, write_report

STEPS = 20  # windows of 4 steps


def rows(steps=STEPS, *, reward=0.5, drop=0.0, grad=1.0, spike=None, entropy=1.0, lost=0.0, mismatch=1e-4):
    """A run: reward `reward` that falls by `drop` over its last window, grad norm `grad` with a
    peak `spike` at step 10, entropy that loses the share `lost` by the last window."""
    last = range(steps - an.window_size(steps) + 1, steps + 1)
    return [
        {
            "step": s,
            "reward/mean": reward - (drop if s in last else 0.0),
            "train/grad_norm": spike if spike is not None and s == 10 else grad,
            "train/entropy": entropy * (1 - lost if s in last else 1.0),
            "train/mismatch_k3_kl": mismatch,
            "train/routing_agreement_engine": 0.97,
            "train/routing_agreement_engine_used": 0.97,
        }
        for s in range(1, steps + 1)
    ]


def runs(mode, *per_seed, k=4):
    """One RunResult per seed of `mode`, each seed's rows as `rows(**kwargs)` makes them."""
    return [an.RunResult(an.Combo("grpo", k, mode), seed, rows(**kwargs)) for seed, kwargs in enumerate(per_seed)]


def judged(results, steps=STEPS):
    window = an.window_size(steps)
    combos = sorted({r.combo for r in results})
    return vd.judge([vd.mode_numbers([r for r in results if r.combo == c], window) for c in combos], steps)


def test_one_seed_per_mode_names_no_winner_however_the_numbers_differ(tmp_path):
    # the README's case: none and R2 the same algorithm at 1x, their mismatch KL 10x apart from
    # chaos alone; and r3 without the reward drop the other two had
    results = [
        *runs("none", {"drop": 0.3, "mismatch": 2.3e-4}, k=1),
        *runs("r2", {"drop": 0.3, "mismatch": 2.3e-5}, k=1),
        *runs("r3", {"mismatch": 1e-6}, k=1),
    ]
    (text,) = write_report(tmp_path, results, ["setup"], STEPS, seeds=1)
    assert text.startswith(
        "At 1× off-policy (grpo), **no difference shown at this scale**: one seed of a mode leaves the spread "
        "between seeds unknown, so no difference can be told from noise (--seeds 3 measures it)."
    )
    assert "most stable" not in text
    assert "reward drop none 0.30 (1 of 1), r2 0.30 (1 of 1), r3 0.00 (0 of 1)" in text
    assert "(shown, not ranked: R3 lowers it by construction): none 2.3e-04; r2 2.3e-05; r3 1.0e-06." in text
    report = (tmp_path / "report.md").read_text()
    assert "Windows here are 4 steps (a fifth of the run, 3 at least" in report
    assert "That takes two seeds per mode at least (--seeds)." in report


def test_two_seeds_per_mode_separated_beyond_their_spread_name_the_winner(tmp_path):
    results = [
        *runs("none", {"drop": 0.40}, {"drop": 0.42}),
        *runs("r2", {"drop": 0.30, "spike": 9.0}, {"drop": 0.31, "spike": 8.0}),
        *runs("r3", {}, {"drop": 0.01}),
    ]
    (text,) = write_report(tmp_path, results, ["setup"], STEPS, seeds=2)
    assert text.startswith(
        "At 4× off-policy (grpo), **r3** was most stable, beyond the spread of 2 seeds per mode: "
        "against none, reward drop r3 0.01 ± 0.01 vs none 0.41 ± 0.01; "
        "against r2, reward drop r3 0.01 ± 0.01 vs r2 0.30 ± 0.01, grad-norm peak r3 1.0× ± 0.0× vs r2 8.5× ± 0.7×."
    )
    assert "grad-norm peak none 1.0× ± 0.0× (0 of 2), r2 8.5× ± 0.7× (2 of 2), r3 1.0× ± 0.0× (0 of 2)" in text
    side = (tmp_path / "report.md").read_text().split("## Every combination side by side")[1]
    assert "| grpo 4× r2 | 2 | 0.500 ± 0.000 → 0.195 ± 0.007 | 0.30 ± 0.01 (2 of 2) | 8.5× ± 0.7× (2 of 2) |" in side


def test_spreads_that_overlap_show_no_difference_and_say_how_many_seeds_would(tmp_path):
    # reward drops 0.00/0.10 against 0.05/0.15: a 0.05 difference at a spread of 0.07
    results = [*runs("none", {}, {"drop": 0.10}), *runs("r3", {"drop": 0.05}, {"drop": 0.15})]
    v = judged(results)
    assert v.winner is None and not v.blockers
    found = v.pairs[0].gaps["reward_drop"]
    assert found.diff == pytest.approx(-0.05) and not found.resolved
    # t(2n-2) * sqrt((0.005 + 0.005) / n) < 0.05 first holds at n = 17 (t = 2.042)
    assert found.seeds == 17
    assert verdict(v).startswith(
        "At 4× off-policy (grpo), **no difference shown at this scale**: no mode's reward drop, grad-norm peak "
        "or entropy collapse differs from another's beyond the spread of 2 seeds per mode. The closest difference, "
        "reward drop none 0.05 ± 0.07 vs r3 0.10 ± 0.07, would take about 17 seeds per mode to resolve at this spread."
    )


def test_a_missing_metric_is_shown_missing_and_never_counts_as_best(tmp_path):
    # r3 logged no reward and no mismatch KL: read as 0.0, it would have the lowest of both
    results = [*runs("none", {"drop": 0.30}, {"drop": 0.32}), *runs("r3", {}, {})]
    for r in results:
        if r.combo.mode == "r3":
            for row in r.rows:
                del row["reward/mean"], row["train/mismatch_k3_kl"]
    (text,) = write_report(tmp_path, results, ["setup"], STEPS, seeds=2)
    assert "**no difference shown at this scale**" in text and "most stable" not in text
    assert "reward drop none 0.31 ± 0.01 (2 of 2), r3 missing" in text
    assert "none 1.0e-04 ± 0.0e+00; r3 missing." in text
    assert "r3 – → –" in text
    side = (tmp_path / "report.md").read_text().split("## Every combination side by side")[1]
    assert "| grpo 4× r3 | 2 | – → – | missing | 1.0× ± 0.0× (0 of 2) | 0 of 2 | 100% ± 0% | missing | 97.0% |" in side


def test_the_lowest_mismatch_kl_does_not_make_a_collapsing_run_most_stable():
    results = [
        *runs("none", {"mismatch": 1e-3}, {"mismatch": 1.2e-3}),
        *runs("r3", {"drop": 0.35, "mismatch": 1e-6}, {"drop": 0.37, "mismatch": 1e-6}),
    ]
    v = judged(results)
    assert v.winner is not None and v.winner.combo.mode == "none"
    assert verdict(v).startswith(
        "At 4× off-policy (grpo), **none** was most stable, beyond the spread of 2 seeds per mode: "
        "against r3, reward drop none 0.00 ± 0.00 vs r3 0.36 ± 0.01."
    )


@pytest.mark.parametrize(
    "trouble, says",
    [
        ({"drop": 0.3}, "reward drop r2 0.00 ± 0.00 vs none 0.30 ± 0.00"),
        ({"spike": 12.0}, "grad-norm peak r2 1.0× ± 0.0× vs none 12.0× ± 0.0×"),
        ({"lost": 0.95}, "entropy collapse r2 0 of 2 vs none 2 of 2"),
    ],
)
def test_each_criterion_separates_the_modes_on_its_own(trouble, says):
    v = judged([*runs("none", trouble, trouble), *runs("r2", {}, {})])
    assert v.winner is not None and v.winner.combo.mode == "r2"
    assert says in verdict(v)


def test_entropy_a_learning_policy_loses_is_no_collapse():
    v = judged([*runs("none", {"lost": 0.6}, {"lost": 0.7}), *runs("r2", {}, {})])
    assert v.winner is None
    assert "entropy collapse none 0 of 2, r2 0 of 2 (entropy kept, last window over first: none 35% ± 7%, r2 100%" in (
        verdict(v)
    )


def test_modes_apart_from_one_but_not_each_other_or_apart_both_ways_name_no_winner():
    v = judged([*runs("none", {"drop": 0.4}, {"drop": 0.4}), *runs("r2", {}, {}), *runs("r3", {}, {})])
    assert v.winner is None
    text = verdict(v)
    assert text.startswith(
        "At 4× off-policy (grpo), **no difference shown at this scale**: r2 was more stable than none (reward drop "
        "r2 0.00 ± 0.00 vs none 0.40 ± 0.00); r3 was more stable than none (reward drop r3 0.00 ± 0.00 vs none "
        "0.40 ± 0.00); no mode was more stable than every other. The other differences are within the rule's "
        "floors (reward drop 0.02, grad-norm peak 1.0×) or missing on one side: more seeds would not make one count."
    )
    both = judged([*runs("none", {"drop": 0.4}, {"drop": 0.4}), *runs("r3", {"spike": 20.0}, {"spike": 20.0})])
    assert both.winner is None
    assert "none and r3 differ both ways (grad-norm peak none 1.0× ± 0.0× vs r3 20.0× ± 0.0×, reward drop" in verdict(
        both
    )


def test_windows_are_several_steps_and_one_noisy_step_is_no_collapse():
    assert [an.window_size(steps) for steps in (2, 5, 10, 16, 20, 60)] == [2, 3, 3, 3, 4, 12]
    dip = [{"step": s, "reward/mean": 0.25 if s == 10 else 0.5} for s in range(1, 11)]
    assert vd.run_numbers(dip, an.window_size(10))["reward_drop"] == pytest.approx(0.25 / 3)  # not above 0.1
    short = judged([*runs("none", {}, {}), *runs("r3", {}, {})], steps=5)
    assert short.blockers == [
        "runs of 5 steps are shorter than two 3-step windows, so no reward collapse, grad-norm spike or "
        "entropy collapse can be judged"
    ]


def test_the_separation_rule_and_the_seeds_estimate():
    assert (vd.t_95(1), vd.t_95(2), vd.t_95(30), vd.t_95(35), vd.t_95(45), vd.t_95(500)) == (
        12.706,
        4.303,
        2.042,
        2.042,
        2.021,
        1.98,
    )
    same = vd.gap([0.1, 0.1], [0.1, 0.1], 0.02)
    assert not same.resolved and same.seeds is None  # within the floor: no number of seeds resolves it
    exact = vd.gap([0.0, 0.0], [0.2, 0.2], 0.02)
    assert exact.resolved and exact.seeds == 2
    one = vd.gap([0.0], [0.5], 0.02)
    assert not one.resolved and one.seeds is None  # one seed: the spread is unknown
    hopeless = vd.gap([0.0, 3.0], [0.03, 3.03], 0.02)
    assert not hopeless.resolved and hopeless.seeds == vd.MAX_SEEDS + 1
