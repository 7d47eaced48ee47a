"""`megatron-rlvr submit`: a multi-node run on Slurm, as one Ray cluster spanning the job's nodes.

    megatron-rlvr submit CONFIG [key=value ...] --nodes N --gpus-per-node G [--partition P]
        [--time T] [--account A] [--dry-run] [--follow]

Checks that the learner world and the rollout engines fit N × G before anything is submitted,
renders slurm/ray-train.sbatch (printed by --dry-run), submits it with sbatch, prints the job
id and log paths; --follow reports the job's state and timeline until it ends and exits with
its status. Imports no torch and no Ray: it runs on a login node in a fraction of a second.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr import run_dir
from megatron_rlvr.config import HFModel, ResolvedConfig, SglangEngine, data_sources, load_config
from megatron_rlvr.errors import UserError
from megatron_rlvr.plan import command as memory_plan

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "ray-train.sbatch"
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class SubmitError(UserError, RuntimeError):
    """A job that cannot be submitted, said in one line."""


# ----------------------------------------------------------------------------- resources
@dataclass(frozen=True)
class Plan:
    """GPU arithmetic of a run on N nodes × G GPUs. Learner ranks and SGLang engines on
    separate GPUs: learner + engines <= N·G, and every engine fits on one node; colocated
    (launch.colocation), the engines take the learner's GPUs, engine.tp dividing a node's."""

    nodes: int
    gpus_per_node: int
    learner_gpus: int
    num_engines: int
    gpus_per_engine: int
    layout: str  # the learner's tp·pp·dp with ep/etp, for messages
    colocated: bool = False  # the engines on the learner's GPUs

    @property
    def engine_gpus(self) -> int:
        """GPUs the engines add to the learner's."""
        return 0 if self.colocated else self.num_engines * self.gpus_per_engine

    def lines(self) -> list[str]:
        total = self.nodes * self.gpus_per_node
        engines = (
            f"{self.num_engines} SGLang engines × engine.tp {self.gpus_per_engine} on the learner's GPUs (colocated)"
            if self.gpus_per_engine and self.colocated
            else f"{self.num_engines} SGLang engines × engine.tp {self.gpus_per_engine} = {self.engine_gpus} GPUs"
            if self.gpus_per_engine
            else f"{self.num_engines} CPU engine{'s' if self.num_engines > 1 else ''} (no GPUs)"
        )
        learner = f"{self.learner_gpus} GPUs" if self.learner_gpus else "CPU (no GPUs)"
        used = self.learner_gpus + self.engine_gpus
        return [
            f"nodes    {self.nodes} × {self.gpus_per_node} GPUs = {total} GPUs",
            f"learner  {self.layout} = {learner}",
            f"rollout  {engines}",
            f"total    {used} of {total} GPUs (learner and engines on {'the same' if self.colocated else 'separate'} GPUs)"
            if used
            else "total    no GPUs: learner ranks and engines take fractions of the nodes' CPUs",
        ]


def plan(cfg: ResolvedConfig, nodes: int, gpus_per_node: int) -> Plan:
    """The run's GPU arithmetic on this allocation; SubmitError (one line) if it cannot fit."""
    if nodes < 1:
        raise SubmitError(f"--nodes {nodes}: needs at least 1 node")
    if gpus_per_node < 0:
        raise SubmitError(f"--gpus-per-node {gpus_per_node}: must be >= 0 (0 for CPU-only nodes)")
    p, engine = cfg.parallel, cfg.rollout.engine
    world = p.tp * p.pp * p.dp
    layout = f"tp {p.tp} · pp {p.pp} · dp {p.dp} (ep {p.ep}, etp {p.etp}) on {p.device}"
    per_engine = engine.tp if isinstance(engine, SglangEngine) and engine.device == "cuda" else 0
    colocated = cfg.launch.colocation.enabled and per_engine > 0 and p.device == "cuda"
    result = Plan(
        nodes, gpus_per_node, world if p.device == "cuda" else 0, cfg.rollout.num_engines, per_engine, layout, colocated
    )
    needed = result.learner_gpus + result.engine_gpus
    total = nodes * gpus_per_node
    if needed and not gpus_per_node:
        raise SubmitError(
            f"--gpus-per-node 0: the config needs {needed} GPUs (learner {result.learner_gpus}, "
            f"engines {result.engine_gpus}); use CPU engines and parallel.device=cpu on CPU nodes"
        )
    if per_engine > gpus_per_node:
        raise SubmitError(
            f"--gpus-per-node {gpus_per_node}: one SGLang engine needs rollout.engine.tp = "
            f"{per_engine} GPUs on a single node"
        )
    if needed > total:
        raise SubmitError(
            f"--nodes {nodes} --gpus-per-node {gpus_per_node} = {total} GPUs cannot hold the run: "
            f"learner tp·pp·dp = {p.tp}·{p.pp}·{p.dp} = {result.learner_gpus} GPUs + rollout "
            f"{result.num_engines} engines × rollout.engine.tp {per_engine} = {result.engine_gpus} "
            f"GPUs = {needed} GPUs"
        )
    if colocated and gpus_per_node % per_engine:
        raise SubmitError(
            f"--gpus-per-node {gpus_per_node}: colocated engines of rollout.engine.tp = {per_engine} take the GPUs "
            "of consecutive learner ranks, so tp must divide a node's GPUs or an engine would span nodes"
        )
    slots = nodes * (gpus_per_node // per_engine) if per_engine else result.num_engines
    if slots < result.num_engines:
        raise SubmitError(
            f"--nodes {nodes} --gpus-per-node {gpus_per_node}: only {slots} engines of "
            f"rollout.engine.tp = {per_engine} GPUs fit whole on the nodes, the config asks for "
            f"rollout.num_engines = {result.num_engines}"
        )
    return result


def check_inputs_present(cfg: ResolvedConfig) -> None:
    """The checkpoint and the prompts must be there before a job is spent on them (the recipes
    ship only a model's config.json, which is enough to check a layout with --dry-run)."""
    if isinstance(cfg.model, HFModel) and not any(Path(cfg.model.path).glob("*.safetensors")):
        raise SubmitError(
            f"model.path = {cfg.model.path!r}: no *.safetensors there (only a config.json to check "
            "the layout with?); point it at your checkpoint: model.path=/path/to/checkpoint"
        )
    for where, source in data_sources(cfg):  # the training data and the eval sets, each maybe several files
        missing = [path for path in getattr(source, "paths", []) if not Path(path).is_file()]
        if missing:
            raise SubmitError(f"{where}.path = {missing[0]!r}: no such file")


# ----------------------------------------------------------------------------- stopping in time
STEP_ALLOWANCE_S = 120  # the step in progress when the signal comes finishes first
CHECKPOINT_WRITE_BYTES_S = 1e9  # an assumed aggregate write rate to the shared file system
CHECKPOINT_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master weights, Adam m and v
CHECKPOINT_DTYPE_BYTES = 2  # the HF checkpoint's bytes a parameter (bf16)


def stop_grace(cfg: ResolvedConfig) -> tuple[int, str]:
    """Seconds between the stop signal and the end of the job that a run needs to finish its
    step and write a checkpoint, sized from the model's checkpoint files, and how: a step
    allowance plus the checkpoint's bytes at an assumed shared-file-system write rate."""
    files = list(Path(cfg.model.path).glob("*.safetensors")) if isinstance(cfg.model, HFModel) else []
    if not files:
        return 300, "no *.safetensors at model.path to size the checkpoint from: 300 s"
    params = sum(f.stat().st_size for f in files) / CHECKPOINT_DTYPE_BYTES
    checkpoint = params * CHECKPOINT_BYTES_PER_PARAM
    seconds = max(120, int(STEP_ALLOWANCE_S + checkpoint / CHECKPOINT_WRITE_BYTES_S))
    return seconds, (
        f"{seconds} s: a step ({STEP_ALLOWANCE_S} s) + a checkpoint of {params / 1e9:.1f}B parameters × "
        f"{CHECKPOINT_BYTES_PER_PARAM} B = {checkpoint / 1e9:.0f} GB at {CHECKPOINT_WRITE_BYTES_S / 1e9:g} GB/s"
    )


# ----------------------------------------------------------------------------- rendering
@dataclass
class JobSpec:
    config: Path
    overrides: list[str]
    nodes: int
    gpus_per_node: int
    log_root: Path
    job_name: str
    workdir: Path = field(default_factory=Path.cwd)
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    sbatch_options: list[str] = field(default_factory=list)
    container: str = ""
    iface: str = ""
    join_timeout_s: int = 300
    stop_grace_s: int = 300  # SIGTERM this long before the time limit: the run saves and stops
    stop_grace_reason: str = ""  # how stop_grace_s was sized, for the script's header
    memory_lines: list[str] = field(default_factory=list)  # the memory plan's table, for the header


def render(spec: JobSpec, resources: Plan, template: Path = TEMPLATE) -> str:
    """The sbatch script for this job: the template with its {{fields}} filled in."""
    q = shlex.quote
    directives = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        "--mem=0",
        *([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []),
        *([f"--partition={spec.partition}"] if spec.partition else []),
        *([f"--time={spec.time}"] if spec.time else []),
        *([f"--account={spec.account}"] if spec.account else []),
        # the job script gets SIGTERM this long before the time limit and passes it to the
        # driver, which finishes its step, saves a checkpoint and stops every node in time
        f"--signal=B:TERM@{spec.stop_grace_s}",
        *spec.sbatch_options,
        f"--output={spec.log_root}/slurm-%j.out",
        f"--chdir={spec.workdir}",
    ]
    for option, value in (
        ("--job-name", spec.job_name),
        ("--partition", spec.partition),
        ("--time", spec.time),
        ("--account", spec.account),
        ("--log-dir", str(spec.log_root)),
        ("the working directory", str(spec.workdir)),
    ):
        if value is not None and (not value or any(c.isspace() or c in "\"'\\" for c in value)):
            # sbatch reads #SBATCH lines without shell quoting: a space would end the value there
            raise SubmitError(f"{option} {value!r}: an #SBATCH value may not hold spaces or quotes")
    for option in spec.sbatch_options:
        if "\n" in option or not option.startswith("-"):
            raise SubmitError(f"--sbatch-option {option!r}: one sbatch option such as --qos=high")
    header = [f"#SBATCH {d}" for d in directives]
    header += ["#", "# Resources (checked by megatron-rlvr submit before submission):"]
    header += [f"#   {line}" for line in resources.lines()]
    if spec.memory_lines:
        header += ["# Memory per GPU (megatron-rlvr plan):", *[f"#   {line}" for line in spec.memory_lines]]
    if spec.stop_grace_reason:
        header += [f"# Stop grace (SIGTERM before the time limit, the driver's time to save): {spec.stop_grace_reason}"]
    fields = {
        "directives": "\n".join(header),
        "workdir": q(str(spec.workdir)),
        "bin": q(str(spec.bin_dir)),
        "log_root": q(str(spec.log_root)),
        "gpus_per_node": str(spec.gpus_per_node),
        "join_timeout_s": str(spec.join_timeout_s),
        "stop_grace_s": str(spec.stop_grace_s),
        "container": spec.container,
        "iface": q(spec.iface),
        "train_args": " ".join(q(a) for a in [str(spec.config), *spec.overrides]),
        "srun_gpus": f"--gpus-per-node={spec.gpus_per_node} " if spec.gpus_per_node else "",
    }
    text = template.read_text()
    missing = sorted(set(re.findall(r"{{(\w+)}}", text)) - set(fields))
    if missing:
        raise SubmitError(f"{template}: unknown template fields {missing}")
    return re.sub(r"{{(\w+)}}", lambda m: fields[m.group(1)], text)


# ----------------------------------------------------------------------------- Slurm commands
def _slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SubmitError(
            f"{name} not found on PATH: run this on a Slurm login node "
            "(or add --dry-run to print the script without submitting)"
        )
    return path


def sbatch(script: str) -> str:
    """Submits the script (on stdin); returns the job id."""
    out = subprocess.run(
        [_slurm_command("sbatch"), "--parsable"], input=script, text=True, capture_output=True, timeout=60
    )
    if out.returncode:
        reason = " ".join(out.stderr.split()) or f"exit code {out.returncode}"
        raise SubmitError(f"sbatch refused the job: {reason}")
    return out.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str, int, str]:
    """(state, exit code, reason) from scontrol, or from sacct once scontrol has forgotten it."""
    out = subprocess.run(
        [_slurm_command("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}
    if "JobState" in fields:
        code, _, signal = fields.get("ExitCode", "0:0").partition(":")
        return fields["JobState"], int(code or 0) or int(signal or 0), fields.get("Reason", "")
    if shutil.which("sacct"):
        acct = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-o", "State,ExitCode", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=30,
        )
        line = acct.stdout.strip().splitlines()[:1]
        if acct.returncode == 0 and line:
            state, _, code = line[0].partition("|")
            return state.split()[0], int(code.partition(":")[0] or 0), ""
    return "UNKNOWN", 1, " ".join(out.stderr.split())


def follow(job_id: str, timeline: Path, out=None, poll_s: float = 0.5) -> int:
    """Reports state changes and the job's timeline lines until it ends; 0 if COMPLETED,
    else the job's exit code (1 when it has none)."""
    out = out or sys.stdout
    start, last, offset = time.monotonic(), None, 0
    while True:
        state, code, reason = job_state(job_id)
        if timeline.exists():
            with timeline.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                print(f"  | {line}", file=out, flush=True)
        if state != last:
            why = f" ({reason})" if reason and reason != "None" else ""
            print(f"job {job_id}: {state}{why} after {time.monotonic() - start:.1f} s", file=out, flush=True)
            last = state
        if state in FINAL_STATES or state == "UNKNOWN":
            if state == "COMPLETED" and code == 0:
                return 0
            return code or 1
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- the command
def add_job_options(group) -> None:
    """The job options `submit` and `compare-replay --submit` share (an argparse parser or
    argument group): where and how the job runs, whatever it trains."""
    group.add_argument("--partition", help="sbatch --partition")
    group.add_argument("--time", help="sbatch --time, e.g. 24:00:00")
    group.add_argument("--account", help="sbatch --account")
    group.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="OPT",
        help="another #SBATCH line: --sbatch-option=--qos=high (repeatable)",
    )
    group.add_argument(
        "--container",
        default="",
        metavar="PREFIX",
        help="prefix for every command on a node, e.g. 'apptainer exec --nv img.sif'",
    )
    group.add_argument(
        "--bin-dir", help="directory with python, ray and megatron-rlvr on the nodes; default: this interpreter's"
    )
    group.add_argument("--iface", default="", help="network interface for Ray, NCCL and gloo (e.g. ib0)")
    group.add_argument(
        "--join-timeout-s", type=int, default=300, help="wait this long for the Ray head and for every node"
    )
    group.add_argument(
        "--stop-grace-s",
        type=int,
        help="SIGTERM the run this long before --time runs out, so it saves and stops (default: a step "
        "plus the checkpoint's size at 1 GB/s, from the model's safetensors; 300 without them)",
    )


def job_spec(
    args: argparse.Namespace, cfg: ResolvedConfig, config: Path, overrides: list[str], log_root: Path, job_name: str
) -> JobSpec:
    """The JobSpec of one job from the shared job options (add_job_options)."""
    spec = JobSpec(
        config=config,
        overrides=overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        log_root=log_root,
        job_name=job_name,
        partition=args.partition,
        time=args.time,
        account=args.account,
        sbatch_options=args.sbatch_option,
        container=args.container,
        iface=args.iface,
        join_timeout_s=args.join_timeout_s,
    )
    if args.stop_grace_s is not None:
        spec.stop_grace_s, spec.stop_grace_reason = args.stop_grace_s, f"{args.stop_grace_s} s (--stop-grace-s)"
    else:
        spec.stop_grace_s, spec.stop_grace_reason = stop_grace(cfg)
    if args.bin_dir:
        spec.bin_dir = Path(args.bin_dir)
    return spec


def add_submit_parser(sub) -> None:
    cmd = sub.add_parser("submit", help="run training on Slurm: a Ray cluster across the job's nodes")
    cmd.add_argument("config", help="YAML config, e.g. configs/qwen3-30b-a3b-grpo-r3.yaml")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    cmd.set_defaults(takes_overrides=True)
    cmd.add_argument("--nodes", type=int, required=True, help="nodes N")
    cmd.add_argument("--gpus-per-node", type=int, required=True, help="GPUs G per node (0: CPU nodes)")
    add_job_options(cmd)
    cmd.add_argument("--job-name", help="default: rlvr-<config name>")
    cmd.add_argument("--log-dir", help="where job logs go; default: <trainer.output_dir>/slurm")
    memory_plan.add_submit_flags(cmd)  # --gpu-memory, --link-gbps, --prompt-tokens, --no-memory-check
    cmd.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    cmd.add_argument("--follow", action="store_true", help="report the job until it ends; exit with its status")


def submit_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    resources = plan(cfg, args.nodes, args.gpus_per_node)
    memory = memory_plan.submit_check(cfg, args)  # the per-GPU table; refuses a GPU over its memory
    log_root = Path(args.log_dir or Path(cfg.trainer.output_dir) / "slurm").absolute()
    spec = job_spec(
        args,
        cfg,
        Path(args.config).absolute(),
        list(args.overrides),
        log_root,
        args.job_name or f"rlvr-{Path(args.config).stem}",
    )
    spec.memory_lines = memory
    script = render(spec, resources)
    if args.dry_run:
        print(script, end="")
        return 0
    check_inputs_present(cfg)
    run_dir.check_output_dir(cfg)  # the job resumes what it finds: never another run's folder
    _slurm_command("sbatch")  # no log folder left behind by a submission that cannot happen
    created = next((d for d in reversed([log_root, *log_root.parents]) if not d.exists()), None)
    log_root.mkdir(parents=True, exist_ok=True)  # Slurm writes the timeline there at once
    try:
        job_id = sbatch(script)
    except SubmitError:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    job_dir = log_root / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.sbatch").write_text(script)
    timeline = log_root / f"slurm-{job_id}.out"
    print(
        f"submitted job {job_id}: {args.nodes} nodes × {args.gpus_per_node} GPUs ({datetime.datetime.now():%H:%M:%S})"
    )
    print(f"  timeline: {timeline}")
    print(f"  driver:   {job_dir / 'driver.log'}")
    print(f"  ray:      {job_dir}/ray-{{head,worker}}-<node>.log")
    print(f"  script:   {job_dir / 'job.sbatch'}")
    for line in memory:
        print(f"  | {line}")
    if not args.follow:
        return 0
    try:
        return follow(job_id, timeline)
    except SubmitError as err:
        print(f"megatron-rlvr submit: {err}", file=sys.stderr)
        return 2
