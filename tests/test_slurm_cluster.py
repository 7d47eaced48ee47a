"""The real-Slurm tier: a local Slurm (munge, slurmctld, two slurmd simulating nodes n1 and n2
on this machine), and a 2-node CPU training job submitted through `megatron-rlvr submit`.

The test installs Slurm with apt when it is missing (root, Debian: munge slurmctld slurmd
slurm-client) and skips, with the exact reason, only where that is impossible. Everything it
starts is private: its own munged socket and key, its own slurm.conf (SLURM_CONF), its own
ports; it stops exactly the daemons it started, by pid. How it works: docs/slurm.md (the real-Slurm test tier).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["munge", "slurmctld", "slurmd", "slurm-client"]
COMMANDS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel"]
NODES = ["n1", "n2"]
FAKE_GPUS = 2  # per node, backed by /dev/null and /dev/zero: for sbatch --test-only of GPU scripts


def _ensure_slurm_installed() -> None:
    """Installs the Slurm packages when a command is missing; pytest.skip with the reason when
    that cannot be done here."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and installing it needs root")
    if shutil.which("apt-get") is None:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if out.returncode:
            tail = " | ".join(out.stderr.strip().splitlines()[-3:])
            pytest.skip(f"cannot install Slurm: `{' '.join(cmd)}` exited {out.returncode}: {tail}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalSlurm:
    """munged + slurmctld + one slurmd per simulated node, all under `root`, all by pid."""

    def __init__(self, root: Path):
        self.root = root
        (root / "log").mkdir()
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _spawn(self, name: str, cmd: list[str], user: str | None = None) -> None:
        with open(self.root / "log" / f"{name}.out", "w") as log:
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    user=user,
                    group=user,
                )
            )

    def _write_munge(self) -> Path:
        munge_dir, sock_dir = self.root / "munge", self.root / "munge-run"
        key = munge_dir / "munge.key"
        for folder, mode in ((munge_dir, 0o700), (sock_dir, 0o755)):
            folder.mkdir()
            shutil.chown(folder, "munge", "munge")
            folder.chmod(mode)
        key.write_bytes(secrets.token_bytes(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        socket_path = sock_dir / "munge.sock"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={sock_dir}/munged.pid",
                f"--seed-file={munge_dir}/seed",
                f"--log-file={munge_dir}/munged.log",
            ],
            user="munge",
        )
        return socket_path

    def _write_conf(self, munge_socket: Path) -> None:
        hw = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
        cpus = int(re.search(r"CPUs=(\d+)", hw).group(1))
        memory = int(re.search(r"RealMemory=(\d+)", hw).group(1)) // 2
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
            f"CPUs={cpus} RealMemory={memory} Gres=gpu:{FAKE_GPUS} State=UNKNOWN"
            for n in NODES
        )
        # GPUs that only exist as a count: enough for sbatch to judge a GPU job's request
        (self.root / "gres.conf").write_text(
            "Name=gpu File=/dev/null,/dev/zero\n"
        )  # two character devices every machine has
        self.conf.write_text(f"""\
ClusterName=rlvr-ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU={memory // cpus}
KillWait=5
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=sched_interval=1
MpiDefault=none
GresTypes=gpu
{nodes}
PartitionName=ci Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout_s: float = 60.0) -> None:
        (self.root / "state").mkdir()
        self._write_conf(self._write_munge())
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True)
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env, timeout=30
            )
            states = dict(line.split() for line in out.stdout.splitlines())
            if all(states.get(node) == "idle" for node in NODES):
                return
            time.sleep(0.25)
        logs = (
            (self.root / "log" / "slurmctld.log").read_text()[-2000:]
            if (self.root / "log" / "slurmctld.log").exists()
            else ""
        )
        raise RuntimeError(f"local Slurm not ready in {timeout_s:g} s: {out.stdout!r} {out.stderr!r}\n{logs}")

    def stop(self) -> None:
        """Cancels any job still there (a failed test's), then stops exactly the daemons this
        object started, by pid: slurmds first, munged last."""
        subprocess.run(["scancel", "--user", str(os.geteuid())], env=self.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=30)
            if queue.returncode or not queue.stdout.strip():
                break
            time.sleep(0.5)
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def local_slurm():
    t0 = time.monotonic()
    _ensure_slurm_installed()
    root = Path(tempfile.mkdtemp(prefix="rlvr-slurm-"))
    root.chmod(0o755)  # munged (as user munge) must reach its socket folder
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        print(f"\nlocal Slurm up (install check + start) in {time.monotonic() - t0:.1f} s")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _job_processes(job_id: str) -> list[str]:
    """Processes that belong to the job: Slurm puts SLURM_JOB_ID in every step's environment."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _submit(local_slurm, out_dir: Path, *extra: str, follow: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """`megatron-rlvr submit` of the tiny CPU run on both nodes; returns the result and job id."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "submit",
            str(REPO / "configs" / "tiny-moe-cpu.yaml"),
            "buffer.batch_groups=2",
            "rollout.n_samples_per_prompt=4",
            f"trainer.output_dir={out_dir}",
            *extra,
            "--nodes",
            "2",
            "--gpus-per-node",
            "0",
            "--time",
            "10:00",
            *(["--follow"] if follow else []),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=local_slurm.env,
        timeout=540,
    )
    print(result.stdout, result.stderr, sep="\n")
    found = re.search(r"submitted job (\d+)", result.stdout)
    assert found, result.stderr
    return result, found.group(1)


def _scontrol(local_slurm, job_id: str) -> str:
    return subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=local_slurm.env, timeout=30
    ).stdout


def _wait(what: str, condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(0.5)


def test_two_node_job_stopped_by_scancel_resumes_from_the_save_it_made(local_slurm, tmp_path):
    """A 2-node job on the local Slurm cluster: Ray spans both nodes before the driver starts;
    `scancel --batch --signal=TERM` mid-run reaches the driver first, which finishes its step,
    saves, and ends with its own exit code (130) while Ray still runs on both nodes; the job
    ends with that code and leaves nothing running. Submitted again, the run resumes from that
    save and finishes."""
    out_dir = tmp_path / "run"
    log_root = out_dir / "slurm"
    metrics = out_dir / "metrics.jsonl"
    _, job_id = _submit(local_slurm, out_dir, "trainer.steps=40")

    _wait("the first training step", lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 300)
    subprocess.run(
        ["scancel", "--batch", "--signal=TERM", job_id],
        env=local_slurm.env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    _wait("the job to end", lambda: "JobState=RUNNING" not in _scontrol(local_slurm, job_id), 300)
    show = _scontrol(local_slurm, job_id)
    timeline = (log_root / f"slurm-{job_id}.out").read_text()
    driver_log = (log_root / job_id / "driver.log").read_text()
    print(timeline, driver_log[-3000:], sep="\n")

    # Ray spanned both nodes before the driver started
    joined = re.findall(r"ray node joined: (n\d) at ", timeline)
    assert sorted(joined) == NODES, timeline
    assert timeline.index("[2/2]") < timeline.index("driver: megatron-rlvr train")
    # the signal reached the driver, which saved and stopped; its exit code is the job's
    assert "job signalled" in timeline and "driver exited with code 130" in timeline, timeline
    assert "ExitCode=130:0" in show, show
    stopped_at = len(metrics.read_text().splitlines())
    assert 1 <= stopped_at < 40
    latest = (out_dir / "checkpoint" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:06d}", (latest, stopped_at)

    # nothing left running: no process of the job, no Ray state left on the nodes (a stop on
    # request is no failure: nothing kept to debug)
    _wait("the job's processes to end", lambda: not _job_processes(job_id), 30)
    _wait("the nodes' Ray folders to go", lambda: not list(Path("/tmp").glob(f"ray-rlvr-{job_id}-*")), 30)

    # the same run again: it resumes from the save the signal made and finishes
    result, again = _submit(local_slurm, out_dir, f"trainer.steps={stopped_at + 1}", "trainer.resume=true", follow=True)
    timeline = (log_root / f"slurm-{again}.out").read_text()
    assert result.returncode == 0, f"{result.stderr}\n{timeline}\n{(log_root / again / 'driver.log').read_text()}"
    assert "JobState=COMPLETED" in _scontrol(local_slurm, again)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped_at + 2)), steps
    for name in ("driver.log", "ray-head-n1.log", "ray-worker-n2.log", "job.sbatch"):
        assert (log_root / again / name).stat().st_size > 0, name
    _wait("the second job's processes to end", lambda: not _job_processes(again), 30)
    assert not list(Path("/tmp").glob(f"ray-rlvr-{again}-*"))


def test_gpu_recipe_script_is_accepted_by_sbatch(local_slurm, tmp_path):
    """The 30B recipe shrunk to 2 nodes × 2 GPUs: real sbatch accepts its GPU directives
    (--test-only: judged by the controller, not run)."""
    script = tmp_path / "job.sbatch"
    render = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "submit",
            str(REPO / "configs" / "qwen3-30b-a3b-grpo-r3.yaml"),
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.ep=2",
            "parallel.dp=2",
            "rollout.engine.tp=1",
            "rollout.num_engines=2",
            f"trainer.output_dir={tmp_path}",
            "--nodes",
            "2",
            "--gpus-per-node",
            str(FAKE_GPUS),
            "--time",
            "10:00",
            "--no-memory-check",  # 30B on 4 GPUs does not fit their memory: only the directives are judged here
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=local_slurm.env,
        timeout=120,
    )
    assert render.returncode == 0, render.stderr
    assert "#SBATCH --gpus-per-node=2" in render.stdout
    script.write_text(render.stdout)
    judged = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=local_slurm.env, timeout=60
    )
    assert judged.returncode == 0 and "to start at" in judged.stderr, judged.stderr
    too_many = subprocess.run(
        ["sbatch", "--test-only", f"--gpus-per-node={FAKE_GPUS + 1}", str(script)],
        capture_output=True,
        text=True,
        env=local_slurm.env,
        timeout=60,
    )
    assert too_many.returncode != 0  # the controller does judge the GPU request
