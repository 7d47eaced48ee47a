"""`megatron-rlvr compare-replay`: the report's tables on made-up metrics, --vary
grids planned, refused, resumed and reported without training (the stability verdict itself:
test_compare_verdict.py), the Slurm path through stand-in
sbatch/scontrol, and real comparisons on the CPU preset: outputs,
routing agreement (R3 uses the engine's routing; bf16 engine vs fp32 learner route apart),
resuming an interrupted comparison, and determinism."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image

from megatron_rlvr import cli
from megatron_rlvr.compare import analysis as an
from megatron_rlvr.compare import command
from megatron_rlvr.compare.plan import CompareError, plan_runs
from megatron_rlvr.compare.report import write_report
from megatron_rlvr.compare.variants import Variant
from megatron_rlvr.config import load_config
from megatron_rlvr.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "compare-replay-cpu.yaml"
PNG = b"\x89PNG\r\n\x1a\n"
TIMING = (
    "time/step_s",
    "weight_sync/seconds",
    "loop/tokens_per_s",
    "loop/engine_busy_fraction",
    "loop/learner_busy_fraction",
)
# engine vs learner logprobs: float rounding that may depend on how the engine batched
ROUNDING = ("train/mismatch_abs_max", "train/mismatch_abs_mean", "train/mismatch_k3_kl")


def compare(*args, **popen):
    command = [sys.executable, "-m", "megatron_rlvr.cli", "compare-replay", *map(str, args)]
    if popen:
        return subprocess.Popen(command, cwd=REPO, **popen)
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)


def rows(steps, *, mismatch, reward=lambda s: 0.5, grad=lambda s: 1.0, natural=0.97, used=0.97):
    return [
        {
            "step": s,
            "reward/mean": reward(s),
            "train/mismatch_k3_kl": mismatch(s),
            "train/grad_norm": grad(s),
            "train/policy_loss": -0.1,
            "train/routing_agreement_engine": natural,
            "train/routing_agreement_engine/layer0": natural,
            "train/routing_agreement_engine_used": used,
            "time/step_s": 1.0,
        }
        for s in range(1, steps + 1)
    ]


# ----------------------------------------------------------------------------- tables
def test_seeds_aggregate_as_mean_and_std(tmp_path):
    results = [
        an.RunResult(an.Combo("grpo", 1, "r3"), seed, rows(10, mismatch=lambda s, k=seed: 1e-5 * (k + 1)))
        for seed in range(2)
    ]
    write_report(tmp_path, results, ["setup"], 10, seeds=2)
    table = [line.split(",") for line in (tmp_path / "table.csv").read_text().splitlines()]
    mismatch = next(row for row in table if row[5] == "train/mismatch_k3_kl")
    assert float(mismatch[6]) == pytest.approx(1.5e-5) and float(mismatch[7]) == pytest.approx(7.071e-6, rel=1e-3)
    assert "1.50e-05 ± 7.07e-06" in (tmp_path / "table.md").read_text()


# ----------------------------------------------------------------------------- arguments
def test_bad_arguments_and_configs_are_one_line_errors(tmp_path):
    done = compare(PRESET, "--modes", "none,r4", "--out", tmp_path)
    assert done.returncode == 2 and "'none,r4': a comma-separated list of none, r2, r3" in done.stderr
    tool = subprocess.run(
        [sys.executable, REPO / "tools" / "compare_routing_replay.py", PRESET, "--seeds", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tool.returncode == 2 and "argument --seeds: '0': an integer >= 1" in tool.stderr
    done = compare(PRESET, "--off-policy", "3", "--out", tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "config error: run grpo-k3-none-s0: algo.num_minibatches = 3" in done.stderr


# ----------------------------------------------------------------------------- --vary
RS = "algo.rollout_correction.rollout_is"
LOWER = "algo.rollout_correction.rollout_is_threshold_lower"


def write_finished(plans, mismatch=lambda plan: 1e-5, reward=lambda plan, s: 0.5):
    """What finished runs leave: every step in metrics.jsonl and the DONE marker."""
    for plan in plans:
        lines = rows(plan.steps, mismatch=lambda s, p=plan: mismatch(p), reward=lambda s, p=plan: reward(p, s))
        (plan.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        plan.mark_done()


def planned(args, out: Path, steps: int = 3):
    """The runs compare-replay plans from its parsed arguments, on the preset at grpo 1×."""
    return plan_runs(
        str(PRESET),
        [],
        load_config(PRESET),
        modes=args.modes,
        algos=["grpo"],
        off_policy=[1],
        varied=args.vary,
        steps=steps,
        seeds=1,
        out=out,
    )


def test_a_vary_grid_is_every_combination_of_its_values_in_each_runs_config(tmp_path):
    args = cli.parse_args(
        [
            "compare-replay",
            str(PRESET),
            "--modes",
            "none,r3",
            "--vary",
            f"{RS}=token,null",
            "--vary",
            f"{LOWER}=null,0.5",
        ]
    )
    plans = planned(args, tmp_path)
    assert [p.name for p in plans] == [
        f"grpo-k1-rollout_correction.rollout_is={rs}+rollout_correction.rollout_is_threshold_lower={lower}-{mode}-s0"
        for rs in ("token", "null")
        for lower in ("null", "0.5")
        for mode in ("none", "r3")
    ]
    last = plans[-1]
    assert (
        last.combo.variant.label
        == "rollout_correction.rollout_is=null, rollout_correction.rollout_is_threshold_lower=0.5"
    )
    assert last.combo.label() == f"grpo 1× r3 ({last.combo.variant.label})"
    for plan in plans:
        cfg = load_config(plan.config)
        settings = dict(plan.combo.variant.settings)
        assert cfg.algo.rollout_correction.rollout_is == {"token": "token", "null": None}[settings[RS]]
        assert cfg.algo.rollout_correction.rollout_is_threshold_lower == {"null": None, "0.5": 0.5}[settings[LOWER]]
        assert cfg.algo.routing_replay == plan.combo.mode and cfg.trainer.output_dir == str(plan.dir)
    assert f"# compare-replay --vary {RS}=token,null\n" in (tmp_path / "comparison.yaml").read_text()
    with pytest.raises(CompareError, match=r"holds runs of another --vary \(see .*comparison.yaml\)"):
        planned(
            cli.parse_args(["compare-replay", str(PRESET), "--modes", "none,r3", "--vary", f"{RS}=token,null"]),
            tmp_path,
        )


@pytest.mark.parametrize(
    "vary, says",
    [
        ("trainer.lr=1e-3,3e-3", "argument --vary: 'trainer.lr=1e-3,3e-3': trainer.lr is not an algo setting"),
        ("algo.num_minibatches=1,2", "'algo.num_minibatches=1,2': algo.num_minibatches is swept by --off-policy"),
        (f"{RS}=token,[1]", f"'{RS}=token,[1]': values are comma-separated YAML scalars"),
        (f"{RS}=", f"'{RS}=': expected algo.KEY=VALUE,VALUE,..."),
        (f"{LOWER}=a b,a/b", "values a b and a/b would name the same run folder"),
    ],
)  # fmt: skip
def test_the_parser_refuses_a_vary_outside_algo_or_not_a_list_of_values(vary, says, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["compare-replay", str(PRESET), "--vary", vary])
    assert exit.value.code == 2 and says in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    "varies, says",
    [
        ([f"{RS}=token,tokn"], f"config error: run grpo-k1-rollout_correction.rollout_is=tokn-none-s0: {RS} = 'tokn': Input"),
        (["algo.rollout_correction.rollout_iss=token"], "algo.rollout_correction.rollout_iss: unknown field (did you mean rollout_is?)"),
        (["algo.stale_negatives.enabled=true"], "-none-s0: algo.stale_negatives.enabled = true: needs algo.rollout_correction.rollout_is"),
        ([f"{RS}=token", f"{RS}=null"], f"megatron-rlvr compare-replay: --vary {RS} is given twice; put all its values in one --vary"),
    ],
)  # fmt: skip
def test_a_vary_the_schema_refuses_is_one_line_naming_its_run_before_any_run_starts(varies, says, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare-replay", str(PRESET), f"{RS}=null", "--modes", "none", "--out", str(out)]
    args = cli.parse_args([*argv, *[word for vary in varies for word in ("--vary", vary)]])
    with pytest.raises(UserError) as err:
        command.main(args)
    assert err.value.report("compare-replay") == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (out / "comparison.yaml").exists()  # so the corrected command is not "another comparison"


def test_a_vary_comparison_run_again_skips_its_finished_runs_and_reports_by_variant(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare-replay", str(PRESET), "--modes", "none,r3", "--steps", "6", "--out", str(out)]
    args = cli.parse_args([*argv, "--vary", f"{RS}=token,null"])
    plans = planned(args, out, steps=6)
    # without weights, reward collapses under none (its last 3-step window)
    write_finished(
        plans,
        mismatch=lambda p: 2e-5 if p.combo.mode == "r3" else 4e-5,
        reward=lambda p, s: 0.2
        if (p.combo.mode, dict(p.combo.variant.settings)[RS]) == ("none", "null") and s > 3
        else 0.5,
    )
    done_at = {p.name: (p.dir / "DONE").stat().st_mtime_ns for p in plans}
    assert command.main(args) == 0
    captured = capsys.readouterr()
    assert "4 runs of 6 steps; 4 finished earlier, 0 to run" in captured.err
    assert {p.name: (p.dir / "DONE").stat().st_mtime_ns for p in plans} == done_at
    token, null = captured.out.splitlines()[:2]
    one_seed = "no difference shown at this scale: one seed of a mode leaves the spread between seeds unknown"
    assert token.startswith(f"At 1× off-policy (grpo, rollout_correction.rollout_is=token), {one_seed}")
    assert null.startswith(f"At 1× off-policy (grpo, rollout_correction.rollout_is=null), {one_seed}")
    assert "reward drop none 0.30 (1 of 1), r3 0.00 (0 of 1)" in null
    assert "reward drop none 0.00 (0 of 1), r3 0.00 (0 of 1)" in token
    assert "entropy collapse none missing, r3 missing" in token  # these runs logged no entropy
    report = (out / "report.md").read_text()
    assert "and in `algo.rollout_correction.rollout_is` (token, null) (--vary: every combination)." in report
    assert "### grpo, 1× off-policy, rollout_correction.rollout_is=null (mean over the run / last window)" in report
    assert (
        "| grpo 1× none (rollout_correction.rollout_is=null) | 1 | 0.500 → 0.200 | 0.30 (1 of 1) | 1.0× (0 of 1) "
        "| missing | missing | 4.0e-05 | 97.0% |" in report
    )
    table = (out / "table.csv").read_text().splitlines()
    assert table[0].startswith("algo,off_policy,variant,mode,")
    assert any(row.startswith("grpo,1,rollout_correction.rollout_is=null,r3,1,reward/mean,") for row in table)
    with pytest.raises(CompareError, match="holds runs of another --vary"):
        command.main(cli.parse_args([*argv, "--vary", f"{RS}=token,null,sequence"]))


def test_a_group_of_one_mode_says_so_and_sits_side_by_side_with_the_others(tmp_path):
    tis, icepop = Variant(0, ((LOWER, "null"),)), Variant(1, ((LOWER, "0.5"),))
    results = [
        an.RunResult(an.Combo("grpo", 4, "none", icepop), 0, rows(10, mismatch=lambda s: 1e-5)),
        an.RunResult(
            an.Combo("grpo", 4, "none", tis),
            0,
            rows(10, mismatch=lambda s: 3e-5, grad=lambda s: 50.0 if s == 8 else 1.0),
        ),
    ]
    verdicts = write_report(tmp_path, results, ["setup"], 10, seeds=1)
    assert verdicts[0].startswith(
        "At 4× off-policy (grpo, rollout_correction.rollout_is_threshold_lower=null), only none ran (1 seed per "
        "mode): there is nothing to compare it with."
    )
    assert "grad-norm peak none 50.0× (1 of 1)" in verdicts[0]
    report = (tmp_path / "report.md").read_text()
    side = report[report.index("## Every combination side by side") :]
    assert side.index("lower=null) | 1 | 0.500 → 0.500 | 0.00 (0 of 1) | 50.0× (1 of 1) |") < side.index(
        "lower=0.5) | 1 | 0.500 → 0.500 | 0.00 (0 of 1) | 1.0× (0 of 1) |"
    )


# ----------------------------------------------------------------------------- Slurm
def _fake_slurm(tmp_path: Path, state: str) -> Path:
    """sbatch that numbers its jobs; scontrol that reports every job in `state` (UNKNOWN: it
    knows no job, as after MinJobAge without accounting)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    counter = tmp_path / "jobs"
    (bin_dir / "sbatch").write_text(
        f"#!/bin/bash\ncat > /dev/null\nn=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 ))\n"
        f'echo $n > {counter}\necho "$n;cluster"\n'
    )
    asked = tmp_path / "scontrol-calls"
    answer = (
        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
        if state == "UNKNOWN"
        else f'echo "JobId=$4 JobState={state} Reason=None ExitCode=0:0"'
    )
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho $4 >> {asked}\n{answer}\n")
    for tool in ("sbatch", "scontrol"):
        (bin_dir / tool).chmod(stat.S_IRWXU)
    return bin_dir


def _slurm_env(tmp_path: Path, state: str) -> dict:
    return dict(os.environ, PATH=os.pathsep.join([str(_fake_slurm(tmp_path, state)), "/usr/bin", "/bin"]))


def _compare_in(env: dict, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_rlvr.cli", "compare-replay", *map(str, args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


def test_submit_takes_submits_job_options_and_needs_the_gpu_count(tmp_path):
    out = tmp_path / "out"
    base = [PRESET, "--modes", "none", "--steps", "3", "--out", out, "--submit"]
    refused = _compare_in(_slurm_env(tmp_path, "RUNNING"), *base)
    assert refused.returncode == 2 and "needs --gpus-per-node" in refused.stderr, refused.stderr
    assert not (tmp_path / "jobs").exists()  # nothing submitted
    options = ["--gpus-per-node", "0", "--iface", "ib0", "--container", "apptainer exec img.sif"]
    options += ["--sbatch-option=--qos=high", "--bin-dir", "/opt/rlvr/bin", "--stop-grace-s", "700"]
    done = _compare_in(_slurm_env(tmp_path, "RUNNING"), *base, *options)
    assert done.returncode == 0, done.stderr
    script = (out / "runs" / "grpo-k1-none-s0" / "job.sbatch").read_text()
    for line in (
        "export RLVR_IFACE=ib0",
        "CONTAINER=(apptainer exec img.sif)",
        "#SBATCH --qos=high",
        "BIN=/opt/rlvr/bin",
        "#SBATCH --signal=B:TERM@700",
    ):
        assert line in script, line


def test_an_unknown_job_is_asked_again_and_never_submitted_twice(tmp_path):
    out = tmp_path / "out"
    args = [PRESET, "--modes", "none", "--steps", "3", "--out", out, "--submit", "--gpus-per-node", "0"]
    assert _compare_in(_slurm_env(tmp_path, "RUNNING"), *args).returncode == 0
    again = _compare_in(_slurm_env(tmp_path, "UNKNOWN"), *args)
    assert again.returncode == 0, again.stderr
    assert "neither scontrol nor sacct knows it after 3 tries; not submitted again" in again.stdout
    assert (tmp_path / "jobs").read_text().strip() == "1"  # still the one job
    assert (tmp_path / "scontrol-calls").read_text().split() == ["1"] * 3  # asked 3 times, then left alone
    assert "1 of 1 runs queued or running" in again.stdout


def test_a_run_that_ends_early_with_its_reason_is_finished_and_reported(tmp_path):
    """train ends a run whose every prompt is always or never solved early, exit 0: the job
    COMPLETED short of its steps is that run's end, with train's reason, not a failure to
    submit again on every invocation."""
    out = tmp_path / "out"
    args = [PRESET, "--modes", "none", "--steps", "6", "--out", out, "--submit", "--gpus-per-node", "0"]
    assert _compare_in(_slurm_env(tmp_path, "RUNNING"), *args).returncode == 0
    run = out / "runs" / "grpo-k1-none-s0"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(4, mismatch=lambda s: 1e-5)))
    reason = "no prompt has anything left to teach: every group was all right or all wrong. checkpoint of step 4"
    (run / "slurm" / "1").mkdir(parents=True)
    (run / "slurm" / "1" / "driver.log").write_text(f"train: 4/6 steps\nmegatron-rlvr train: {reason}\n")
    done = _compare_in(_slurm_env(tmp_path, "COMPLETED"), *args)
    assert done.returncode == 0, done.stderr
    assert f"job 1 completed at step 4 of 6: {reason}" in done.stdout
    assert (tmp_path / "jobs").read_text().strip() == "1"  # not submitted again
    assert json.loads((run / "DONE").read_text())["ended_early"] == reason
    assert f"ended at step 4 of 6: {reason}" in (out / "report.md").read_text()
    # a job that COMPLETED short of its steps without saying why is submitted again
    (run / "DONE").unlink()
    (run / "slurm" / "1" / "driver.log").write_text("train: 4/6 steps\n")
    again = _compare_in(_slurm_env(tmp_path, "COMPLETED"), *args)
    assert "ended COMPLETED with 4 of 6 steps logged; submitting again" in again.stdout
    assert (tmp_path / "jobs").read_text().strip() == "2"


def test_one_comparison_at_a_time_in_an_out_folder(tmp_path):
    from megatron_rlvr.compare.plan import run_lock

    out = tmp_path / "out"
    args = [PRESET, "--modes", "none", "--steps", "3", "--out", out, "--submit", "--gpus-per-node", "0"]
    with run_lock(out):
        busy = _compare_in(_slurm_env(tmp_path, "RUNNING"), *args)
    assert busy.returncode == 2, busy.stderr
    assert f"--out {out} is in use by another compare-replay (pid {os.getpid()}" in busy.stderr
    assert not (tmp_path / "jobs").exists() and not (out / "runs").exists()
    assert _compare_in(_slurm_env(tmp_path, "RUNNING"), *args).returncode == 0  # released


def test_submit_makes_one_job_per_run_and_collects_them_when_completed(tmp_path):
    out = tmp_path / "out"
    args = [PRESET, "--modes", "none,r3", "--vary", "algo.advantage.baseline_type=group_mean,rloo"]
    args += ["--steps", "3", "--out", out, "--submit", "--gpus-per-node", "0"]
    names = [f"grpo-k1-advantage.baseline_type={b}-{m}-s0" for b in ("group_mean", "rloo") for m in ("none", "r3")]

    def env(state: str) -> dict:
        return dict(os.environ, PATH=os.pathsep.join([str(_fake_slurm(tmp_path, state)), "/usr/bin", "/bin"]))

    first = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", "compare-replay", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env("RUNNING"),
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    for job, name in enumerate(names, start=1):
        assert f"{name}: submitted job {job}" in first.stdout
    assert "4 of 4 runs queued or running" in first.stdout
    script = (out / "runs" / names[-1] / "job.sbatch").read_text()
    assert f"TRAIN=({out / 'runs' / names[-1] / 'config.yaml'})" in script
    assert "baseline_type: rloo" in (out / "runs" / names[-1] / "config.yaml").read_text()
    for name in names:  # what the jobs wrote
        lines = rows(3, mismatch=lambda s, m=4e-5 if "-none-" in name else 2e-5: m)
        (out / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    second = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", "compare-replay", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env("COMPLETED"),
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    assert f"{names[0]}: job 1 completed" in second.stdout
    for baseline in ("group_mean", "rloo"):
        assert f"At 1× off-policy (grpo, advantage.baseline_type={baseline}), no difference shown" in second.stdout
    assert "runs of 3 steps are shorter than two 3-step windows" in second.stdout
    assert (out / "report.html").exists() and all((out / "runs" / name / "DONE").exists() for name in names)


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    done = compare(PRESET, "--modes", "none,r3", "--steps", "6", "--out", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done


def metrics(out: Path, name: str) -> list[dict]:
    return an.read_metrics(out / "runs" / name / "metrics.jsonl")


def test_a_comparison_writes_the_table_the_plots_and_the_report(compared):
    out, done = compared
    assert "[1/2] grpo-k1-none-s0" in done.stderr and "[2/2] grpo-k1-r3-s0" in done.stderr  # progress
    assert (
        "At 1× off-policy (grpo), no difference shown at this scale: one seed of a mode leaves the spread"
        in done.stdout
    )
    # the rule reads what real runs log: every criterion has a number (none is missing)
    assert re.search(r"reward drop none \d\.\d\d \([01] of 1\), r3 \d\.\d\d \([01] of 1\)", done.stdout)
    assert re.search(r"grad-norm peak none \d+\.\d× \([01] of 1\), r3 \d+\.\d× \([01] of 1\)", done.stdout)
    assert re.search(
        r"entropy collapse none [01] of 1, r3 [01] of 1 \(entropy kept, .*: none \d+%, r3 \d+%\)", done.stdout
    )
    assert re.search(
        r"Mismatch KL, last window \(shown, not ranked: .*\): none \d\.\de-\d\d; r3 \d\.\de-\d\d\.", done.stdout
    )
    table = (out / "table.csv").read_text().splitlines()
    assert table[0] == "algo,off_policy,variant,mode,seeds,metric,mean,mean_std,last,last_std"
    for metric in (
        "reward/mean",
        "train/policy_loss",
        "train/clipfrac",
        "train/approx_kl",
        "train/mismatch_abs_mean",
        "train/mismatch_abs_max",
        "train/mismatch_k3_kl",
        "train/rollout_is_mean",
        "train/routing_agreement_engine",
        "train/routing_agreement_engine/layer1",
        "train/grad_norm",
        "time/step_s",
    ):
        assert any(f",none,1,{metric}," in row for row in table) and any(f",r3,1,{metric}," in row for row in table)
    plots = sorted((out / "plots").glob("*.png"))
    assert len(plots) >= 10
    for plot in plots:
        assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == PNG
        with Image.open(plot) as image:  # a whole, decodable PNG
            image.load()
            assert image.format == "PNG" and image.size[0] > 300
    report = (out / "report.md").read_text()
    assert "Which mode kept training stable" in report and "Rule: stability is judged" in report
    assert "Windows here are 3 steps" in report
    assert "![mismatch KL rollout → learner (k3)](plots/train_mismatch_k3_kl.png)" in report
    assert "<img src='plots/reward_mean.png'" in (out / "report.html").read_text()
    models = {
        (out / "runs" / name / "model" / "model.safetensors").read_bytes()
        for name in ("grpo-k1-none-s0", "grpo-k1-r3-s0")
    }
    assert len(models) == 1  # the same initial weights


def test_r3_routes_as_the_engine_while_natural_routing_differs_under_the_preset(compared):
    out, _ = compared
    r3, none = metrics(out, "grpo-k1-r3-s0"), metrics(out, "grpo-k1-none-s0")
    assert all(m["train/routing_agreement_engine_used"] == 1.0 for m in r3)  # by construction
    natural = [m["train/routing_agreement_engine"] for m in r3 + none]
    assert all(0.5 < a <= 1.0 for a in natural) and min(natural) < 1.0  # bf16 engine, fp32 learner
    assert all(m["train/routing_agreement_engine_used"] == m["train/routing_agreement_engine"] for m in none)


@pytest.mark.slow  # two more real runs; the comparison itself runs in the default tier
def test_an_interrupted_comparison_resumes_without_redoing_finished_runs(compared, tmp_path):
    out = tmp_path / "out"
    args = [PRESET, "--modes", "none,r3", "--steps", "6", "--out", out]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    log = open(tmp_path / "first.log", "w")
    proc = compare(*args, stdout=log, stderr=subprocess.STDOUT)
    first_done, second_log = out / "runs" / "grpo-k1-none-s0" / "DONE", out / "runs" / "grpo-k1-r3-s0" / "train.log"
    deadline = time.monotonic() + 600
    while not (second_log.exists() and second_log.stat().st_size) and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    assert first_done.exists()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(300) == 130
    log.close()
    assert (
        "stopped by SIGINT during run grpo-k1-r3-s0; 1 of 2 runs finished and kept"
        in (tmp_path / "first.log").read_text()
    )
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # its run stopped too
    kept = first_done.stat().st_mtime_ns, (first_done.parent / "metrics.jsonl").read_bytes()
    done = compare(*args)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "1 finished earlier, 1 to run" in done.stderr
    assert (first_done.stat().st_mtime_ns, (first_done.parent / "metrics.jsonl").read_bytes()) == kept
    # determinism: the same configs, run here and in the other comparison, log the same metrics
    reference, _ = compared
    for name in ("grpo-k1-none-s0", "grpo-k1-r3-s0"):
        ours, theirs = metrics(out, name), metrics(reference, name)
        assert [m["step"] for m in ours] == [1, 2, 3, 4, 5, 6]
        for a, b in zip(ours, theirs):
            assert set(a) == set(b)
            for key in set(a) - set(TIMING) - set(ROUNDING):
                assert a[key] == b[key], (name, a["step"], key)
            for key in ROUNDING:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (name, a["step"], key)
