"""The code verifier and the sandbox: solutions as models write them, tests as datasets store
them, and everything a hostile or broken solution can try (loops, fork and memory bombs,
shell commands, sockets, writes outside its directory, signals) ending as a 0 with a reason,
within the time limit, with no process left behind and nothing written elsewhere."""

import json
import os
import tempfile

import psutil
import pytest

from megatron_rlvr.rewards.code.verifier import CodeTestError, CodeVerifier, extract_code, parse_tests
from megatron_rlvr.rewards.isolation import check_available, seccomp_program
from megatron_rlvr.rewards.reasoning import strip_reasoning
from megatron_rlvr.rewards.runner import run_jobs

ADD = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]}  # APPS / PRIME layout


def py(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt reads two numbers."


@pytest.fixture(scope="module")
def verifier():
    check_available()
    return CodeVerifier(timeout_s=2.0, memory_mb=512, max_output_kb=64, parallel=2)


def sandbox_processes() -> list:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "megatron_rlvr.rewards.runner" in " ".join(p.info["cmdline"] or [])
    ]


def leftover_dirs() -> set:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("rlvr-sandbox-")}


def test_stdin_stdout_solutions_get_the_right_reward_or_a_zero_with_a_reason(verifier, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    before_dirs, before_files = leftover_dirs(), sorted(os.listdir(tmp_path))
    cases = {
        "correct": (py("a, b = map(int, input().split())\nprint(a + b)"), 1.0, "passed"),
        "reads fd 0, exits early": (
            py("import sys\na, b = map(int, open(0).read().split())\nprint(a + b)\nsys.exit()"),
            1.0,
            "passed",
        ),
        "uses a thread": (
            py(
                "import threading\nout = []\nt = threading.Thread(target=lambda: out.append("
                "sum(map(int, input().split()))))\nt.start(); t.join()\nprint(out[0])"
            ),
            1.0,
            "passed",
        ),
        "writes in its own directory": (
            py("open('scratch', 'w').write(input())\na, b = map(int, open('scratch').read().split())\nprint(a + b)"),
            1.0,
            "passed",
        ),
        "wrong": (py("a, b = map(int, input().split())\nprint(a - b)"), 0.0, "wrong_answer"),
        "exception": (py("print(1 // 0)"), 0.0, "runtime_error"),
        "syntax error": (py("def f(:\n  pass"), 0.0, "syntax_error"),
        "infinite loop": (py("while True:\n    pass"), 0.0, "timeout"),
        "sleeps": (py("import time\ntime.sleep(60)"), 0.0, "timeout"),
        "closes its pipes, then loops": (
            py(
                "import os\nfor fd in range(3, 64):\n    try:\n        os.close(fd)\n"
                "    except OSError:\n        pass\nwhile True:\n    pass"
            ),
            0.0,
            "timeout",
        ),
        "fork bomb": (py("import os\nwhile True:\n    os.fork()"), 0.0, "sandbox_violation"),
        # past the 512 MiB limit in one request: the verdict cannot depend on how fast it grows
        "memory bomb": (py("hog = [bytearray(10**7)]\nhog.append(bytearray(2 * 10**9))"), 0.0, "memory"),
        "os.system": (
            py(f"import os\nos.system('touch {tmp_path}/pwned')\na, b = map(int, input().split())\nprint(a + b)"),
            0.0,
            "sandbox_violation",
        ),
        "subprocess": (py("import subprocess\nsubprocess.run(['true'])"), 0.0, "sandbox_violation"),
        "socket": (
            py("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)"),
            0.0,
            "sandbox_violation",
        ),
        "writes outside": (py(f"open('{tmp_path}/pwned', 'w').write('x')"), 0.0, "sandbox_violation"),
        "deletes outside": (py(f"import os\nos.remove('{victim}')"), 0.0, "sandbox_violation"),
        "chmods outside": (py(f"import os\nos.chmod('{victim}', 0o777)"), 0.0, "sandbox_violation"),
        "kills its parent": (py("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"), 0.0, "sandbox_violation"),
        "floods stdout": (py("while True:\n    print('x' * 4096)"), 0.0, "output_limit"),
        "fakes a verdict": (py("import os\nos._exit(0)"), 0.0, "crashed"),
        "no answer": ("<think>a+b is easy... let me write", 0.0, "no_answer"),
    }
    verdicts = verifier.verify_batch([response for response, _, _ in cases.values()], json.dumps(ADD))
    got = {name: verdict for name, verdict in zip(cases, verdicts)}
    # the slow cases end in "timeout" verdicts: the bound ended them, not their own end
    assert got == {name: (reward, reason) for name, (_, reward, reason) in cases.items()}
    assert victim.read_text() == "keep me" and oct(victim.stat().st_mode & 0o777) != "0o777"
    assert sorted(os.listdir(tmp_path)) == before_files  # nothing written, created or removed outside
    assert leftover_dirs() <= before_dirs  # the sandbox's own directories are gone
    assert not sandbox_processes()  # no supervisor or child left running


def test_a_timed_out_test_is_killed_at_its_deadline():
    jobs = [{"code": "while True: pass", "tests": [{"kind": "stdio", "input": ""}]}]
    outcome = run_jobs(jobs, wall_s=1.0, memory_mb=256, output_bytes=4096, parallel=1)[0]["tests"][0]
    assert outcome["status"] == "timeout"  # a loop that never ends: only the deadline ends it
    assert outcome["seconds"] >= 1.0  # and not before the deadline


def test_assert_and_call_style_tests(verifier):
    mbpp = {"test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "test_imports": []}
    assert verifier.verify_batch(
        [
            "def add(a, b):\n    return a + b",
            py("def add(a, b):\n    return 3"),
            py("def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # example"),
            py("import os\ndef add(a, b):\n    os._exit(0)"),
        ],
        mbpp,
    ) == [(1.0, "passed"), (0.0, "wrong_answer"), (1.0, "passed"), (0.0, "crashed")]
    humaneval = {
        "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
        "entry_point": "total",
    }
    assert verifier.verify_batch(
        [py("def total(xs):\n    return sum(xs)"), py("def total(xs):\n    return 3")], humaneval
    ) == [(1.0, "passed"), (0.0, "wrong_answer")]
    leetcode = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]}
    solution = (
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return (seen[target - x], i)\n            seen[x] = i"
    )
    assert verifier.verify_batch([py(solution), py("def twoSum(nums, target):\n    return [0, 1]")], leetcode) == [
        (1.0, "passed"),
        (0.0, "wrong_answer"),
    ]


def test_fraction_reward_counts_tests_passed():
    fraction = CodeVerifier(timeout_s=2.0, memory_mb=512, max_output_kb=64, reward="fraction", parallel=1)
    half = py("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)")
    assert fraction.verify_batch([half], ADD) == [(pytest.approx(2 / 3), "wrong_answer")]


def test_outputs_compare_token_by_token_with_a_float_tolerance(verifier):
    tests = [{"input": "", "output": "0.3333333\n1 2 3"}]
    assert verifier.verify_batch([py("print(1/3)\nprint('1  2 3  ')"), py("print(0.34)\nprint(1, 2, 3)")], tests) == [
        (1.0, "passed"),
        (0.0, "wrong_answer"),
    ]


@pytest.mark.parametrize(
    "tests, kinds",
    [
        ('{"inputs": ["1\\n"], "outputs": ["2\\n"]}', ["stdio"]),  # verl keeps ground truth as a JSON string
        ({"inputs": [["1", "2"]], "outputs": [["3"]]}, ["stdio"]),  # TACO: lines as lists
        ({"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]}, ["call"]),
        ({"fn_name": "f", "inputs": ["[1, 2]"], "outputs": [3]}, ["call"]),
        ([{"input": "1", "output": "1"}, {"input": "2", "output": "2"}], ["stdio", "stdio"]),
        (["assert f(1) == 1", "assert f(2) == 2"], ["assert", "assert"]),
        ("assert f(1) == 1\nassert f(2) == 2", ["assert"]),
        ({"test": "def check(c):\n    assert c(1) == 1", "entry_point": "f"}, ["assert"]),
    ],
)
def test_dataset_test_layouts_parse(tests, kinds):
    assert [t["kind"] for t in parse_tests(tests)] == kinds


@pytest.mark.parametrize(
    "tests",
    [
        {"inputs": ["1"], "outputs": []},
        {"foo": 1},
        [],
        "",
        7,
        [3],
        {"test": "def check(c): pass", "entry_point": "f"},  # judges nothing
        "assert f(1 ==",
        {"test": "def check(c):\n    assert c(1) == 1"},  # check() that nothing calls
    ],
)
def test_unusable_tests_are_refused(tests):
    with pytest.raises(CodeTestError):
        parse_tests(tests)


def test_code_and_answers_are_found_after_the_reasoning():
    assert strip_reasoning("<think>maybe 3</think>\nThe answer is 4") == "The answer is 4"
    assert strip_reasoning("the prompt opened <think>; so 3 </think> 4") == "4"  # R1-style templates
    assert strip_reasoning("<think>still thinking, 3") == ""  # cut off: no answer
    assert strip_reasoning("plain 5") == "plain 5"
    response = "<think>```python\nprint(0)\n```</think>Final:\n```py\nprint(1)\n```\n```\nprint(2)\n```"
    assert extract_code(response).strip() == "print(1)"  # a python block wins over a bare one
    assert extract_code("```\nprint(2)\n```").strip() == "print(2)"
    assert extract_code("print(3)") == "print(3)"


def test_the_seccomp_filter_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        program = seccomp_program(machine, 4242)
        assert len(program) % 8 == 0 and len(program) // 8 < 256
