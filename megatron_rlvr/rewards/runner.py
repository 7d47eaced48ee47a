"""Runs model-written code and users' verifier functions in the sandbox, one batch of jobs per
supervisor process.

The parent side (`run_jobs`) starts `python -m megatron_rlvr.rewards.runner` in a fresh
temporary directory and session, sends it the jobs, and kills the whole session if it
outlives its budget; the directory is removed afterwards. The supervisor confines itself
(isolation: capabilities dropped, writes only under that directory) and runs every test or
function call in a forked child that adds the seccomp filter and rlimits, with a wall-time
deadline. A child can start no process, so killing it leaves nothing behind.

No verdict is made where model-written code ran, and nothing it could compare against is
there: the supervisor never sees an expected output. stdin/stdout tests send back what the
code printed; function calls and the calls under test of assert-style tests (code.asserts)
send back what it returned, as plain data (code.values), and the parent judges. An assert
test's judge program (its expected side) runs in a child of a separate supervisor that is
given no model code. A child may also read only the Python installation, system libraries and
its own directory, so no dataset file on disk is in its reach.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_rlvr.rewards.code.values import NotAValue, RecordedValues, ValueFailed, encode_value

STARTUP_S = 10.0  # a supervisor's allowance beyond its jobs' budgets (interpreter start, imports)
Started = tuple[subprocess.Popen, str]  # a supervisor process and its directory


# ============================================================================ parent side
def run_jobs(
    jobs: list[dict],
    *,
    wall_s: float,
    memory_mb: int,
    output_bytes: int,
    parallel: int,
    function: dict | None = None,
    started: list[Started] | None = None,
) -> list[dict]:
    """One result per job, in order: {"tests": [per-test outcome]} for code jobs, {"outcome"}
    for function calls and judge programs. `parallel` supervisors share the jobs; those in
    `started` (start_supervisors) are used first, and any left over are stopped."""
    count = min(parallel, len(jobs))
    spare = list(started or [])
    supervisors = [spare.pop(0) if spare else _start() for _ in range(count)]
    stop_supervisors(spare)
    if not jobs:
        return []
    chunks = [list(range(i, len(jobs), parallel)) for i in range(count)]
    results: list[dict | None] = [None] * len(jobs)
    settings = {"wall_s": wall_s, "memory_mb": memory_mb, "output_bytes": output_bytes, "function": function}
    with ThreadPoolExecutor(count) as pool:
        answered = pool.map(lambda c, s: _supervise(s, [jobs[i] for i in c], settings), chunks, supervisors)
        for chunk, answers in zip(chunks, answered):
            for index, answer in zip(chunk, answers):
                results[index] = answer
    return results  # type: ignore[return-value]


def start_supervisors(count: int) -> list[Started]:
    """Supervisors started before their jobs are known (each waits for them on its stdin), so
    that their interpreter start overlaps other work; run_jobs uses or stops them."""
    return [_start() for _ in range(count)]


def stop_supervisors(started: list[Started]) -> None:
    """Kills those still waiting and removes their directories (a no-op for those run_jobs ran)."""
    for proc, workdir in started:
        if proc.poll() is None:
            _kill_session(proc)
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate()
        shutil.rmtree(workdir, ignore_errors=True)


def _start() -> Started:
    workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    proc = subprocess.Popen(
        [sys.executable, "-B", "-P", "-m", "megatron_rlvr.rewards.runner"],  # -P: its directory is no import path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
    )
    return proc, workdir


def _supervise(supervisor: Started, jobs: list[dict], settings: dict) -> list[dict]:
    proc, workdir = supervisor
    budget = len(jobs) * (settings["wall_s"] + 1.0) + STARTUP_S
    try:
        out, err = proc.communicate(json.dumps({**settings, "workdir": workdir, "jobs": jobs}).encode(), timeout=budget)
        missing = {"reason": "sandbox_error", "detail": err.decode(errors="replace").strip()[-300:]}
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        missing = {"reason": "timeout", "detail": f"the supervisor outlived its {budget:.0f} s budget"}
    finally:
        if proc.poll() is None:
            _kill_session(proc)
            proc.communicate()
        shutil.rmtree(workdir, ignore_errors=True)
    answers = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return answers[: len(jobs)] + [{"error": missing}] * (len(jobs) - len(answers))


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ============================================================================ supervisor side
def in_child(target, settings: dict, *, wall_s: float, stdin_data: str = "") -> dict:
    """Runs target() (→ a JSON-able dict) in a forked, confined child with a wall-time deadline.
    Returns {"status": ..., "output": stdout text, ...target's dict}: what the child reports is
    data for the parent to judge, never a verdict (the child can write anything there)."""
    from megatron_rlvr.rewards.isolation import confine_child, die_with_parent, install_seccomp, limit_resources

    memory_mb, output_bytes = settings["memory_mb"], settings["output_bytes"]
    scratch = os.path.abspath(tempfile.mkdtemp(dir="."))
    with open(os.path.join(scratch, "stdin"), "w") as f:
        f.write(stdin_data)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # ------------------------------------------------------------ child
        try:
            os.close(read_end)
            die_with_parent()
            os.chdir(scratch)
            os.dup2(os.open("stdin", os.O_RDONLY), 0)
            os.dup2(os.open("stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
            os.dup2(os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            os.closerange(3, write_end)
            os.closerange(write_end + 1, 1024)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            limit_resources(memory_mb=memory_mb, cpu_s=int(wall_s) + 1, file_bytes=output_bytes)
            if settings.get("readable") is not None:  # model-written code, or a judge program
                confine_child(scratch, settings["readable"])
            install_seccomp()
            report = target()
            try:
                sys.stdout.flush()
            except OSError as err:  # what is left over the output limit
                report = _error(err)
            message = json.dumps(report).encode()
            if len(message) > output_bytes:
                message = json.dumps({"status": "output_limit", "detail": "returned values too large"}).encode()
            os.write(write_end, message)
        except MemoryError:
            os.write(write_end, b'{"status": "memory"}')
        finally:
            os._exit(0)
    # ------------------------------------------------------------------------------ parent
    os.close(write_end)
    deadline = started + wall_s
    received = b""
    while (left := deadline - time.monotonic()) > 0:  # the report, until the child closes the pipe
        if select.select([read_end], [], [], left)[0]:
            chunk = os.read(read_end, 65536)
            if not chunk or len(received) > output_bytes:  # a flood is no report
                break
            received += chunk
    os.close(read_end)
    timed_out, status = _reap(pid, deadline)
    output = _read(os.path.join(scratch, "stdout"), output_bytes)
    shutil.rmtree(scratch, ignore_errors=True)
    seconds = round(time.monotonic() - started, 3)
    if timed_out:
        return {"status": "timeout", "seconds": seconds}
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        reason = {
            int(signal.SIGSYS): "sandbox_violation",
            int(signal.SIGXCPU): "timeout",
            int(signal.SIGKILL): "timeout",
            int(signal.SIGXFSZ): "output_limit",
        }.get(sig, "crashed")
        return {"status": reason, "detail": signal.Signals(sig).name, "seconds": seconds}
    try:
        report = json.loads(received)
    except (ValueError, RecursionError):  # not JSON, or nested to break the parser
        report = None
    if not isinstance(report, dict) or not isinstance(report.get("status"), str):
        return {"status": "crashed", "detail": "exited without a report", "seconds": seconds}
    return {**report, "output": output, "seconds": seconds}


def _reap(pid: int, deadline: float) -> tuple[bool, int]:
    """Waits for the child until the deadline (a child that closed its pipe may still run),
    then kills it. Returns (killed at the deadline, wait status)."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return False, status
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    return True, os.waitpid(pid, 0)[1]


def _read(path: str, limit: int) -> str:
    """The child's output file; never a link the child put in its place (to a file it may
    not read itself, such as a dataset's expected output)."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _error(err: BaseException) -> dict:
    if isinstance(err, MemoryError):
        return {"status": "memory"}
    if isinstance(err, AssertionError):
        return {"status": "wrong_answer", "detail": "AssertionError"}
    if isinstance(err, SyntaxError):
        return {"status": "syntax_error", "detail": str(err)[:200]}
    detail = f"{type(err).__name__}: {str(err)[:200]}"
    if isinstance(err, PermissionError):  # Landlock refused a write outside the sandbox's directory
        return {"status": "sandbox_violation", "detail": detail}
    if isinstance(err, OSError) and err.errno == errno.EFBIG:  # RLIMIT_FSIZE: too much output
        return {"status": "output_limit", "detail": detail}
    return {"status": "runtime_error", "detail": detail}


def _run_solution(code: str, namespace: dict) -> dict | None:
    """Executes the solution as __main__; a verdict when it did not run to its end."""
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            return {"status": "runtime_error", "detail": f"exit code {stop.code}"}
    except BaseException as err:  # the solution's own errors are the verdict
        return _error(err)
    return None


def _steps(test: dict, namespace: dict) -> dict:
    """An assert test's steps (code.asserts), in order: its statements run, and an error in one
    ends the test as it would end the script; each value step's value is sent back as plain
    data, or what it raised, which the judge raises where the test reads that value."""
    values: list = []
    raised: list[list] = []
    for kind, source in test["steps"]:
        if kind == "exec":
            exec(compile(source, "<test>", "exec"), namespace)
            continue
        try:
            values.append(encode_value(eval(compile(source, "<test>", "eval"), namespace)))
        except NotAValue as err:
            values.append(None)
            raised.append([len(values) - 1, {"status": "not_a_value", "detail": f"returned {err}"[:200]}])
        except BaseException as err:  # the solution's own errors are the verdict, where the test reads the value
            values.append(None)
            raised.append([len(values) - 1, _error(err)])
    return {"status": "returned", "values": values, "raised": raised}


def _code_test(code: str, test: dict):
    def target() -> dict:
        # a script reads its input as __main__; code under test is imported, as the tests do
        name = "__main__" if test["kind"] == "stdio" else "solution"
        namespace: dict[str, Any] = {"__name__": name, "__builtins__": __builtins__}
        failed = _run_solution(code, namespace)
        if failed is not None or test["kind"] == "stdio":
            return failed or {"status": "ran"}
        try:
            if test["kind"] == "assert":
                return _steps(test, namespace)
            function = namespace.get(test["fn"])
            if function is None and isinstance(namespace.get("Solution"), type):
                function = getattr(namespace["Solution"](), test["fn"], None)
            if not callable(function):
                return {"status": "runtime_error", "detail": f"no function {test['fn']!r}"}
            return {"status": "returned", "value": encode_value(function(*test["args"]))}
        except NotAValue as err:
            return {"status": "not_a_value", "detail": f"returned {err}"[:200]}
        except BaseException as err:
            return _error(err)

    return target


def _code_job(job: dict, settings: dict) -> dict:
    deadline = time.monotonic() + settings["wall_s"]
    outcomes = []
    for test in job["tests"]:
        left = deadline - time.monotonic()
        if left <= 0.05:
            outcomes.append({"status": "timeout"})
            continue
        outcome = in_child(_code_test(job["code"], test), settings, wall_s=left, stdin_data=test.get("input", ""))
        outcomes.append(outcome)
        if outcome["status"] in ("sandbox_violation", "syntax_error"):
            break  # the same for every test
    return {"tests": outcomes}


def call_function(function, response: str, record: dict, caught: type[BaseException] = BaseException) -> dict:
    """One verifier function call as an outcome: {"status": "scored", "value"}, or why not (an
    exception of `caught`, or a return that is not a number); where it runs is the caller's
    choice (in the caller's own process, Exception: a Ctrl-C or an exit is not a verdict)."""
    try:
        value = function(response, record)
    except caught as err:
        return _error(err)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return {"status": "bad_return", "detail": f"returned {type(value).__name__}, not a number"}
    return {"status": "scored", "value": float(value)}


def _function_job(job: dict, function, settings: dict) -> dict:
    def target() -> dict:
        return call_function(function, job["response"], job["record"])

    return {"outcome": in_child(target, settings, wall_s=settings["wall_s"])}


def _judge_job(job: dict, settings: dict) -> dict:
    """An assert test's judge program (its expected side, from the dataset) run on the values a
    solution sent back; the process that runs it has never run model-written code."""

    def target() -> dict:
        try:
            recorded = RecordedValues(job["values"], job.get("raised") or [])
            exec(compile(job["judge"], "<test>", "exec"), {"__name__": "judge", "_rlvr_value": recorded})
        except ValueFailed as failed:
            return failed.outcome
        except BaseException as err:
            return _error(err)
        return {"status": "passed"}

    return {"outcome": in_child(target, settings, wall_s=settings["wall_s"])}


def readable_paths() -> list[str]:
    """What a child may read: the Python installation (the standard library, installed
    packages) and system libraries; no home, data or temporary directory."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    system = ["/usr", "/lib", "/lib64", "/etc", "/sys/devices/system/cpu", "/dev/null", "/dev/urandom", "/dev/zero"]
    return sorted({os.path.realpath(p) for p in [*prefixes, *system] if os.path.exists(p)})


def load_function(spec: dict):
    """spec: {"module": dotted name or file path, "function": name, "search": [dirs]}."""
    import importlib
    import importlib.util

    sys.path[:0] = [d for d in spec.get("search", []) if d not in sys.path]
    module_name = spec["module"]
    if module_name.endswith(".py"):
        loader_spec = importlib.util.spec_from_file_location("rlvr_user_verifier", module_name)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot load {module_name} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, spec["function"])


def _serve() -> None:
    from megatron_rlvr.rewards.isolation import confine_writes, drop_capabilities

    task = json.loads(sys.stdin.read())
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing a user's module prints can corrupt the protocol
    function = None
    if task.get("function"):
        try:
            function = load_function(task["function"])  # the user's own module, before confinement
        except BaseException as err:
            failed = {"outcome": {"status": "load_error", "detail": f"{type(err).__name__}: {err}"[:300]}}
            for _ in task["jobs"]:
                protocol.write(json.dumps(failed) + "\n")
            return
    drop_capabilities()
    confine_writes(task["workdir"])
    task["readable"] = None if function else readable_paths()  # a user's own verifier may read its files
    for job in task["jobs"]:
        if function:
            answer = _function_job(job, function, task)
        else:
            answer = _judge_job(job, task) if "judge" in job else _code_job(job, task)
        protocol.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    _serve()
