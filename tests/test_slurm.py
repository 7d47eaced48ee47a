"""`megatron-rlvr submit` without a Slurm: resource arithmetic, the rendered script, the
shipped recipes through --dry-run, one-line refusals before sbatch, and submission through
stand-in sbatch/scontrol commands. The real Slurm tier is tests/test_slurm_cluster.py."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlvr.config import ConfigError, load_config
from megatron_rlvr.launch import slurm

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"
QWEN3_30B = REPO / "configs" / "qwen3-30b-a3b-grpo-r3.yaml"
QWEN3_235B = REPO / "configs" / "qwen3-235b-a22b-gspo.yaml"


def _submit(*args, path_dir: Path | None = None, tool: str = "cli"):
    """Runs submit with PATH = the stand-in Slurm commands (if any) and the basic tools, so a
    real sbatch on this machine is never reached."""
    env = dict(os.environ, PATH=os.pathsep.join([str(path_dir), "/usr/bin", "/bin"]) if path_dir else "/nonexistent")
    entry = ["-m", "megatron_rlvr.cli", "submit"] if tool == "cli" else [str(REPO / "tools" / "submit_slurm.py")]
    return subprocess.run(
        [sys.executable, *entry, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )


def _fake_slurm(tmp_path: Path, job_id: str = "4242", states=("RUNNING", "COMPLETED"), exit_code="0:0"):
    """sbatch that keeps its script and args; scontrol that walks through `states`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    (bin_dir / "sbatch").write_text(
        f'#!/bin/bash\necho "$@" >> {calls}\ncat > {tmp_path}/submitted.sbatch\necho "{job_id};cluster"\n'
    )
    counter = tmp_path / "polls"
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f"states=({' '.join(states)})\n"
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}\n"
        "i=$(( n < ${#states[@]} ? n : ${#states[@]} - 1 ))\n"
        f'echo "JobId=$4 JobName=x JobState=${{states[$i]}} Reason=None ExitCode={exit_code}"\n'
    )
    for tool in ("sbatch", "scontrol"):
        (bin_dir / tool).chmod(stat.S_IRWXU)
    return bin_dir, calls


# ----------------------------------------------------------------------------- arithmetic
def test_recipes_fit_their_nodes_exactly():
    p30 = slurm.plan(load_config(QWEN3_30B), nodes=4, gpus_per_node=8)
    assert (p30.learner_gpus, p30.engine_gpus) == (16, 16)
    p235 = slurm.plan(load_config(QWEN3_235B), nodes=16, gpus_per_node=8)
    assert (p235.learner_gpus, p235.engine_gpus) == (64, 64)
    assert p235.lines()[-1] == "total    128 of 128 GPUs (learner and engines on separate GPUs)"


@pytest.mark.parametrize(
    "overrides, nodes, gpus, expected",
    [
        (
            [],
            3,
            8,
            "--nodes 3 --gpus-per-node 8 = 24 GPUs cannot hold the run: learner tp·pp·dp = "
            "2·2·4 = 16 GPUs + rollout 4 engines × rollout.engine.tp 4 = 16 GPUs = 32 GPUs",
        ),
        ([], 8, 2, "--gpus-per-node 2: one SGLang engine needs rollout.engine.tp = 4 GPUs on a single node"),
        ([], 4, 0, "--gpus-per-node 0: the config needs 32 GPUs"),
        (
            [
                "parallel.tp=1",
                "parallel.pp=1",
                "parallel.ep=1",
                "parallel.dp=4",
                "rollout.engine.tp=5",
                "rollout.num_engines=5",
            ],
            4,
            8,
            "only 4 engines of rollout.engine.tp = 5 GPUs fit whole on the nodes, the config asks for "
            "rollout.num_engines = 5",
        ),
        ([], 0, 8, "--nodes 0: needs at least 1 node"),
    ],
)
def test_resources_that_cannot_hold_the_run(overrides, nodes, gpus, expected):
    with pytest.raises(slurm.SubmitError) as err:
        slurm.plan(load_config(QWEN3_30B, overrides), nodes, gpus)
    assert expected in str(err.value)


def test_cpu_runs_need_no_gpus():
    plan = slurm.plan(load_config(TINY), nodes=2, gpus_per_node=0)
    assert plan.learner_gpus == plan.engine_gpus == 0
    assert "no GPUs" in plan.lines()[-1]


# ----------------------------------------------------------------------------- rendering
@pytest.mark.parametrize(
    "config, nodes, expected",
    [
        (
            QWEN3_30B,
            4,
            [
                "learner  tp 2 · pp 2 · dp 4 (ep 8, etp 1) on cuda = 16 GPUs",
                "rollout  4 SGLang engines × engine.tp 4 = 16 GPUs",
            ],
        ),
        (
            QWEN3_235B,
            16,
            [
                "learner  tp 4 · pp 2 · dp 8 (ep 32, etp 1) on cuda = 64 GPUs",
                "rollout  8 SGLang engines × engine.tp 8 = 64 GPUs",
            ],
        ),
        (
            REPO / "configs" / "mixtral-8x7b-grpo-r3.yaml",
            4,
            [
                "learner  tp 2 · pp 2 · dp 4 (ep 8, etp 1) on cuda = 16 GPUs",
                "rollout  4 SGLang engines × engine.tp 4 = 16 GPUs",
            ],
        ),
    ],
)
def test_recipe_dry_run_renders_a_valid_script(config, nodes, expected, tmp_path):
    out = _submit(
        config,
        "--nodes",
        nodes,
        "--gpus-per-node",
        8,
        "--partition",
        "gpu",
        "--time",
        "24:00:00",
        "--account",
        "rl",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    script = out.stdout
    for directive in (
        f"--nodes={nodes}",
        "--gpus-per-node=8",
        "--partition=gpu",
        "--time=24:00:00",
        "--account=rl",
        "--exclusive",
    ):
        assert f"#SBATCH {directive}\n" in script
    for line in expected:
        assert f"#   {line}\n" in script
    assert f"TRAIN=({config})" in script and "{{" not in script
    (tmp_path / "job.sbatch").write_text(script)
    syntax = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    # #SBATCH lines count only before the first command
    first_command = next(i for i, line in enumerate(script.splitlines()[1:], 1) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH"))


def test_overrides_container_and_interface_reach_the_script():
    out = _submit(
        TINY,
        "trainer.steps=3",
        "--nodes",
        2,
        "--gpus-per-node",
        0,
        "algo.kind=gspo",
        "--container",
        "apptainer exec --nv /img/rlvr.sif",
        "--iface",
        "ib0",
        "--sbatch-option=--qos=high",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    assert f"TRAIN=({TINY} trainer.steps=3 algo.kind=gspo)" in out.stdout
    assert "CONTAINER=(apptainer exec --nv /img/rlvr.sif)" in out.stdout
    assert "export RLVR_IFACE=ib0" in out.stdout and "#SBATCH --qos=high\n" in out.stdout
    assert "--gpus-per-node" not in out.stdout  # CPU nodes: no GPU requests at all


# ----------------------------------------------------------------------------- bad input
def test_bad_resources_are_one_line_and_nothing_is_submitted(tmp_path):
    bin_dir, calls = _fake_slurm(tmp_path)
    out = _submit(QWEN3_30B, "--nodes", 2, "--gpus-per-node", 8, path_dir=bin_dir)
    assert out.returncode == 2 and not calls.exists()
    assert out.stderr.splitlines() == [
        "megatron-rlvr submit: --nodes 2 --gpus-per-node 8 = 16 GPUs cannot hold the run: learner "
        "tp·pp·dp = 2·2·4 = 16 GPUs + rollout 4 engines × rollout.engine.tp 4 = 16 GPUs = 32 GPUs"
    ]


def test_config_errors_are_reported_like_train():
    out = _submit(TINY, "parallel.ep=3", "--nodes", 1, "--gpus-per-node", 0, "--dry-run")
    assert out.returncode == 2
    assert out.stderr.splitlines()[0] == "config error: parallel.ep = 3: must divide the model's 4 experts"
    assert all(line.startswith("config error: ") for line in out.stderr.splitlines())


def test_no_sbatch_on_path_is_a_clear_message(tmp_path):
    out = _submit(TINY, f"trainer.output_dir={tmp_path / 'run'}", "--nodes", 2, "--gpus-per-node", 0)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "megatron-rlvr submit: sbatch not found on PATH: run this on a Slurm login node "
        "(or add --dry-run to print the script without submitting)"
    ]


def test_recipe_without_a_checkpoint_is_refused_before_sbatch(tmp_path):
    bin_dir, calls = _fake_slurm(tmp_path)
    out = _submit(QWEN3_30B, "--nodes", 4, "--gpus-per-node", 8, path_dir=bin_dir)
    assert out.returncode == 2 and not calls.exists()
    assert "model.path = 'configs/hf-configs/Qwen3-30B-A3B': no *.safetensors there" in out.stderr
    out = _submit(
        TINY, "data={type: file, path: /data/none.jsonl}", "--nodes", 1, "--gpus-per-node", 0, path_dir=bin_dir
    )
    assert out.returncode == 2 and not calls.exists()
    assert out.stderr.splitlines() == ["megatron-rlvr submit: data.path = '/data/none.jsonl': no such file"]


# ----------------------------------------------------------------------------- submission
def test_submit_prints_job_and_logs_and_follow_exits_with_the_job_status(tmp_path):
    bin_dir, calls = _fake_slurm(tmp_path, states=("PENDING", "RUNNING", "COMPLETED"))
    out_dir = tmp_path / "run"
    out = _submit(
        TINY, f"trainer.output_dir={out_dir}", "--nodes", 2, "--gpus-per-node", 0, "--follow", path_dir=bin_dir
    )
    assert out.returncode == 0, out.stderr
    assert calls.read_text().split() == ["--parsable"]
    log_root = out_dir / "slurm"
    assert "submitted job 4242: 2 nodes × 0 GPUs" in out.stdout
    assert f"timeline: {log_root}/slurm-4242.out" in out.stdout
    assert f"driver:   {log_root}/4242/driver.log" in out.stdout
    assert (log_root / "4242" / "job.sbatch").read_text() == (tmp_path / "submitted.sbatch").read_text()
    states = [line.split(":")[1].split()[0] for line in out.stdout.splitlines() if line.startswith("job 4242")]
    assert states == ["PENDING", "RUNNING", "COMPLETED"]


def test_follow_reports_a_failed_job_with_its_exit_code(tmp_path):
    bin_dir, _ = _fake_slurm(tmp_path, states=("RUNNING", "FAILED"), exit_code="2:0")
    out = _submit(
        TINY,
        f"trainer.output_dir={tmp_path / 'run'}",
        "--nodes",
        1,
        "--gpus-per-node",
        0,
        "--follow",
        path_dir=bin_dir,
        tool="tools",
    )
    assert out.returncode == 2 and "job 4242: FAILED" in out.stdout


def test_follow_streams_the_timeline(tmp_path, capsys, monkeypatch):
    bin_dir, _ = _fake_slurm(tmp_path, states=("RUNNING", "RUNNING", "COMPLETED"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    timeline = tmp_path / "slurm-7.out"
    timeline.write_text("[12:00:00 +0.0s] job 7 on 2 nodes\n[12:00:01 +1.0s] partial")
    assert slurm.follow("7", timeline, poll_s=0.01) == 0
    out = capsys.readouterr().out
    assert "  | [12:00:00 +0.0s] job 7 on 2 nodes" in out and "partial" not in out  # whole lines only


def test_the_slurm_page_shows_the_recipes_as_rendered():
    readme = (REPO / "docs" / "slurm.md").read_text()
    shared = Path("/shared/megatron-rlvr")
    for config, nodes, model in ((QWEN3_30B, 4, "Qwen3-30B-A3B"), (QWEN3_235B, 16, "Qwen3-235B-A22B")):
        name = config.stem
        spec = slurm.JobSpec(
            config=shared / "configs" / config.name,
            nodes=nodes,
            gpus_per_node=8,
            overrides=[f"model.path=/data/{model}", "data.path=/data/math.jsonl"],
            log_root=shared / "runs" / name / "slurm",
            job_name=f"rlvr-{name}",
            workdir=shared,
            bin_dir=shared / ".venv" / "bin",
            partition="gpu",
            time="48:00:00",
        )
        script = slurm.render(spec, slurm.plan(load_config(config), nodes, 8)).splitlines()
        if nodes == 4:  # shown whole: header and settings
            end = script.index(next(line for line in script if line.startswith("# ---- end of rendered")))
            assert "\n".join(script[4 : end + 1]) in readme
        resources = script.index("# Resources (checked by megatron-rlvr submit before submission):")
        assert "\n".join(script[resources : resources + 5]) in readme


@pytest.mark.parametrize("flag, value", [("--job-name", "my job"), ("--partition", "gpu 'a'"), ("--account", 'lab"x')])
def test_sbatch_values_that_would_be_cut_short_are_refused(flag, value):
    out = _submit(TINY, "--nodes", 1, "--gpus-per-node", 0, flag, value, "--dry-run")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"megatron-rlvr submit: {flag} {value!r}: an #SBATCH value may not hold spaces or quotes"
    ]


def test_a_used_output_folder_is_refused_before_sbatch_and_a_job_resumes(tmp_path):
    bin_dir, calls = _fake_slurm(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    out = _submit(TINY, f"trainer.output_dir={used}", "--nodes", 1, "--gpus-per-node", 0, path_dir=bin_dir)
    assert out.returncode == 2 and not calls.exists()
    assert "holds a run (metrics up to step 2)" in out.stderr and "trainer.resume=true" in out.stderr
    script = _submit(TINY, "--nodes", 1, "--gpus-per-node", 0, "--dry-run").stdout
    assert 'train "${TRAIN[@]}" trainer.resume=true' in script  # a requeued job continues its run


@pytest.mark.parametrize("hf_config", sorted(p.name for p in (REPO / "configs" / "hf-configs").iterdir() if p.is_dir()))
def test_every_shipped_hf_config_gets_a_layout_from_the_qwen3_30b_recipe(hf_config):
    """Each family's published config.json (configs/hf-configs/) is read as the run reads it
    (expert count under its own key), and the 4-node recipe's layout holds it."""
    path = REPO / "configs" / "hf-configs" / hf_config
    if json.loads((path / "config.json").read_text())["num_hidden_layers"] % 2:
        # DeepSeek-V3's 61 layers: two pipeline stages are refused in one line; one stage lays out
        with pytest.raises(ConfigError, match=r"parallel.pp = 2: must divide the 61 layers"):
            load_config(QWEN3_30B, [f"model.path={path}"])
        cfg = load_config(QWEN3_30B, [f"model.path={path}", "parallel.pp=1", "parallel.dp=8"])
        assert "learner  tp 2 · pp 1 · dp 8 (ep 8, etp 1) on cuda = 16 GPUs" in slurm.plan(cfg, 4, 8).lines()
        return
    cfg = load_config(QWEN3_30B, [f"model.path={path}"])
    assert "learner  tp 2 · pp 2 · dp 4 (ep 8, etp 1) on cuda = 16 GPUs" in slurm.plan(cfg, 4, 8).lines()


# ----------------------------------------------------------------------------- the nodes' side
def test_the_head_takes_the_interface_address_and_one_node_ip_flag():
    from megatron_rlvr.launch import ray_join

    ip, port = ray_join.head_address("lo")
    assert ip == "127.0.0.1" and 0 < port < 65536
    with pytest.raises(ray_join.JoinError, match="no such network interface"):
        ray_join.head_address("no-such-if0")
    script = slurm.TEMPLATE.read_text()
    assert 'ray_join address --iface "$RLVR_IFACE"' in script
    # the head's address reaches `ray start` once, through the node wrapper, never as an argument too
    head_line = next(line for line in script.splitlines() if line.startswith('node_step "$HEAD_NODE" head'))
    assert "--node-ip-address" not in head_line and '"$HEAD_IP"' in head_line
    assert script.count("--node-ip-address=") == 1


def test_workers_wait_for_the_head_within_a_bound():
    import socket

    from megatron_rlvr.launch import ray_join

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert ray_join.wait_for_head(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
        closed = server.getsockname()[1]
    assert not ray_join.wait_for_head(f"127.0.0.1:{closed}", timeout_s=1, poll_s=0.1)
    script = slurm.TEMPLATE.read_text()
    assert script.index("ray_join wait-head") < script.index('node_step "$node" worker')


def test_the_stop_grace_is_sized_from_the_checkpoint(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((QWEN3_30B.parent / "hf-configs" / "Qwen3-30B-A3B" / "config.json").read_text())
    cfg = load_config(QWEN3_30B, [f"model.path={model}"])
    assert slurm.stop_grace(cfg)[0] == 300  # nothing to size it from
    with open(model / "model.safetensors", "wb") as f:  # 30B bf16 parameters' worth of bytes
        f.truncate(61 * 10**9)
    seconds, how = slurm.stop_grace(cfg)
    assert seconds == 120 + int(30.5e9 * 14 / 1e9) and "30.5B parameters" in how
