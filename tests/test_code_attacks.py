"""Solutions that try to forge their verdict instead of computing the answer: each must score 0
with a reason, while honest solutions pass the same tests. Every test form is covered: MBPP
asserts, HumanEval check(candidate), APPS stdin/stdout and APPS/LeetCode function calls."""

import json

import psutil
import pytest

from megatron_rlvr.rewards.code.values import NotAValue, decode_value, encode_value
from megatron_rlvr.rewards.code.verifier import CodeTestError, CodeVerifier, parse_tests
from megatron_rlvr.rewards.isolation import check_available

MBPP = {"test_list": ["assert add(2, 3) == 5", "assert add(10, -4) == 6"], "test_imports": []}
MBPP_FLOAT = {
    "test_list": ["assert math.isclose(area(2), 12.566, rel_tol=0.001)", "assert set(common([1, 2], [2, 3])) == {2}"],
    "test_imports": ["import math"],
}
HUMANEVAL = {
    "test": "METADATA = {'author': 'x'}\n\ndef check(candidate):\n"
    "    assert candidate([1.0, 2.0]) == 3.0\n    assert abs(candidate([0.1, 0.2]) - 0.3) < 1e-6\n"
    "    assert candidate([]) == 0\n    assert True, 'this prints if it fails'\n",
    "entry_point": "total",
}
STDIO = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
CALL = {"fn_name": "add", "inputs": [[2, 3], [10, -4]], "outputs": [5, 6]}

# Reaches the verdict pipe of the process that ran it (and the nonce, where there was one).
FRAME_WALK = """
import sys, os, json
def add(a, b):
    frame = sys._getframe()
    while frame is not None:
        if 'write_end' in frame.f_locals:
            claim = {'nonce': frame.f_locals.get('nonce'), 'status': 'passed'}
            os.write(frame.f_locals['write_end'], json.dumps(claim).encode())
            os._exit(0)
        frame = frame.f_back
    return a - b
"""
# Floods the report pipe with a claim far over the output limit.
FLOOD = """
import sys, os
def add(a, b):
    frame = sys._getframe()
    while 'write_end' not in frame.f_locals:
        frame = frame.f_back
    os.write(frame.f_locals['write_end'], b'{"status": "returned", "values": [' + b'5, ' * 10**6 + b'6]}')
    return a + b
"""
# Reports a value nested deep enough to break a JSON parser (and the supervisor with it).
DEEP = FLOOD.replace("b'5, ' * 10**6 + b'6]}'", "b'[' * 30000 + b']' * 30000 + b']}'").replace(
    "return a + b", "os._exit(0)"
)
# Reads the expected value from the code of the test that called it.
CALLER_CONSTANTS = """
import sys
def add(a, b):
    consts = [c for c in sys._getframe(1).f_code.co_consts if type(c) is int and c not in (a, b)]
    return consts[0] if consts else 0
"""


def returns(expression: str, setup: str = "", name: str = "add") -> str:
    return f"{setup}\ndef {name}(*args):\n    return {expression}\n"


def always_equal(base: str) -> str:
    return f"class Sneaky({base}):\n    __eq__ = lambda self, other: True\n    __hash__ = {base}.__hash__\n"


def reads_dataset(path) -> str:
    """Finds its own test in the dataset file on disk and returns what it expects."""
    return f"""
import re
def add(a, b):
    text = open({str(path)!r}).read()
    found = re.search(r'add\\({{}}, {{}}\\) == (-?\\d+)'.format(a, b), text)
    return int(found.group(1)) if found else 0
"""


def attacks(dataset) -> dict[str, tuple[str, str]]:
    """name → (solution for MBPP's add, reason it must fail with)."""
    return {
        "int subclass whose __eq__ is always True": (returns("Sneaky(0)", always_equal("int")), "not_a_value"),
        "walks frames to the verdict pipe": (FRAME_WALK, "crashed"),
        "reads expected values from the caller's code": (CALLER_CONSTANTS, "wrong_answer"),
        "floods the report pipe": (FLOOD, "crashed"),
        "reports a value nested 30000 deep": (DEEP, "crashed"),
        "writes beside its own directory": (returns("a + b", "open('../json.py', 'w').write('')"), "sandbox_violation"),
        "os._exit(0) in the call": (returns("__import__('os')._exit(0)"), "crashed"),
        "os._exit(0) at import": ("import os\ndef add(a, b):\n    return 0\nos._exit(0)", "crashed"),
        "patches operator.eq and builtins": (
            returns("0", "import operator, builtins\noperator.eq = lambda a, b: True\nbuiltins.abs = lambda x: 0"),
            "wrong_answer",
        ),
        "replaces AssertionError": (
            returns("0", "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})"),
            "wrong_answer",
        ),
        "prints a fake verdict": (
            returns("0", "import json\nprint(json.dumps({'tests': [{'status': 'passed'}] * 2}))"),
            "wrong_answer",
        ),
        "raises SystemExit(0)": (returns("(_ for _ in ()).throw(SystemExit(0))"), "runtime_error"),
        "reads the dataset file": (reads_dataset(dataset), "sandbox_violation"),
        "spins until the deadline": (returns("0", "while True:\n    pass"), "timeout"),
        "str subclass": (returns("Sneaky('5')", always_equal("str")), "not_a_value"),
        "float subclass": (returns("Sneaky(0.0)", always_equal("float")), "not_a_value"),
        "list subclass": (returns("Sneaky([])", always_equal("list")), "not_a_value"),
        "custom object with __eq__": (
            returns("Any()", "class Any:\n    def __eq__(self, other):\n        return True"),
            "not_a_value",
        ),
        "NaN": (returns("float('nan')"), "wrong_answer"),
    }


HONEST_ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def verifier():
    check_available()
    return CodeVerifier(timeout_s=2.0, memory_mb=512, max_output_kb=64, parallel=2)


def score(verifier, solutions: dict[str, str], tests) -> dict[str, tuple[float, str]]:
    responses = [f"```python\n{code}\n```" for code in solutions.values()]
    return dict(zip(solutions, verifier.verify_batch(responses, tests)))


def test_mbpp_attacks_score_zero_and_an_honest_add_passes(verifier, tmp_path):
    dataset = tmp_path / "mbpp.jsonl"
    dataset.write_text(json.dumps({"prompt": "add two numbers", "tests": MBPP}) + "\n")
    cases = attacks(dataset)
    got = score(verifier, {"honest": HONEST_ADD, **{name: code for name, (code, _) in cases.items()}}, MBPP)
    assert got == {"honest": (1.0, "passed"), **{name: (0.0, reason) for name, (_, reason) in cases.items()}}


def test_call_and_stdio_attacks_score_zero_and_honest_solutions_pass(verifier, tmp_path):
    cases = attacks(tmp_path / "missing.jsonl")
    forged = {name: cases[name] for name in ("int subclass whose __eq__ is always True", "str subclass", "NaN")}
    forged["custom object with __eq__"] = cases["custom object with __eq__"]
    forged["walks frames to the verdict pipe"] = cases["walks frames to the verdict pipe"]
    got = score(verifier, {"honest": HONEST_ADD, **{name: code for name, (code, _) in forged.items()}}, CALL)
    assert got == {"honest": (1.0, "passed"), **{name: (0.0, reason) for name, (_, reason) in forged.items()}}

    for a, b in ([2, 3], [10, -4]):  # expected outputs stored one file per test (as CodeContests does)
        (tmp_path / f"out_{a}_{b}.txt").write_text(f"{a + b}\n")
    stdio = {
        "honest": "a, b = map(int, input().split())\nprint(a + b)",
        "links its output file to the expected one": (
            f"import os\na, b = input().split()\nos.remove('stdout')\nos.symlink(f'{tmp_path}/out_{{a}}_{{b}}.txt', 'stdout')"
        ),
        "prints a fake verdict": 'print(\'{"tests": [{"status": "passed"}]}\')',
        "prints nan": "print('nan')",
        "exits before printing": "import os\nos._exit(0)",
    }
    assert score(verifier, stdio, STDIO) == {
        "honest": (1.0, "passed"),
        "links its output file to the expected one": (0.0, "wrong_answer"),
        "prints a fake verdict": (0.0, "wrong_answer"),
        "prints nan": (0.0, "wrong_answer"),
        "exits before printing": (0.0, "crashed"),
    }


def test_humaneval_and_judge_program_attacks(verifier):
    solutions = {
        "honest": "def total(xs):\n    return sum(xs)",
        "float subclass": always_equal("float") + "def total(xs):\n    return Sneaky(0.0)",
        "patches abs so the tolerance check passes": (
            "import builtins\nbuiltins.abs = lambda x: 0\ndef total(xs):\n    return {(1.0, 2.0): 3.0, (): 0}.get(tuple(xs), 7.0)"
        ),
        "NaN under a tolerance": "def total(xs):\n    return float('nan') if xs else 0",
        "off by a little": "def total(xs):\n    return sum(xs) + 1e-3",
    }
    assert score(verifier, solutions, HUMANEVAL) == {
        "honest": (1.0, "passed"),
        "float subclass": (0.0, "not_a_value"),
        "patches abs so the tolerance check passes": (0.0, "wrong_answer"),
        "NaN under a tolerance": (0.0, "wrong_answer"),
        "off by a little": (0.0, "wrong_answer"),
    }
    # every response fails before the judge programs: the judges started for them are stopped
    assert score(verifier, {"exits": "import os\nos._exit(0)", "loops": "while True:\n    pass"}, HUMANEVAL) == {
        "exits": (0.0, "crashed"),
        "loops": (0.0, "timeout"),
    }
    assert not [p for p in psutil.process_iter(["cmdline"]) if "rewards.runner" in " ".join(p.info["cmdline"] or [])]
    mbpp = {
        "honest": "def area(r):\n    return 3.14159 * r * r\ndef common(a, b):\n    return list(set(a) & set(b))",
        "patches math.isclose": (
            "import math\nmath.isclose = lambda *a, **k: True\n"
            "def area(r):\n    return 0\ndef common(a, b):\n    return [2]"
        ),
    }
    for tests in (MBPP_FLOAT, {**MBPP_FLOAT, "test_imports": []}):  # some datasets forget `import math`
        assert score(verifier, mbpp, tests) == {
            "honest": (1.0, "passed"),
            "patches math.isclose": (0.0, "wrong_answer"),
        }


def test_the_sandbox_never_sees_an_expected_value():
    sent = [t["steps"] for t in parse_tests(MBPP) + parse_tests(HUMANEVAL)]
    assert "5" not in json.dumps(sent[0]) and "0.3" not in json.dumps(sent[2])
    assert sent[0] == [["value", "add(2, 3)"]]
    unimported = parse_tests(["assert math.isclose(area(2), 12.566)"])[0]  # math is the test's, not the solution's
    assert unimported["steps"] == [["value", "area(2)"]] and "import math" in unimported["program"]
    assert sent[2] == [["value", "total([1.0, 2.0])"], ["value", "total([0.1, 0.2])"], ["value", "total([])"]]


@pytest.mark.parametrize(
    "test",
    [
        "def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i\ncheck(f)",
        "assert all(f(x) == x for x in range(3))",
        "r = f(1) + 1\nassert f(r) == 2",
        "def helper():\n    return f(1)\nassert helper() == 1",
        "assert list(map(f, [1, 2])) == [2, 4]",
        "assert np.allclose(f(1), [1.0])",
        "np.testing.assert_allclose(f(1), [1.0])",
        "s = Stack()\ns.push(1)\nassert len(s) == 1",
        "s = Stack()\nassert s.size() == 0 or s.pop() == 1",
    ],
)
def test_tests_that_only_the_solutions_process_could_judge_are_refused(test):
    with pytest.raises(CodeTestError, match="judged outside|in the solution's process|could change") as refused:
        parse_tests(test)
    assert str(refused.value).startswith("test line ") and "\n" not in str(refused.value)


def test_values_cross_as_exact_builtins_only():
    plain = [1, -(2**80), 0.5, float("inf"), "s", None, True, (1, "a"), {1: [2]}, {3}, frozenset({4}), b"\x00", 1j]
    assert decode_value(json.loads(json.dumps(encode_value(plain)))) == plain
    for forged in (type("I", (int,), {})(1), type("S", (str,), {})("a"), [type("L", (list,), {})()], object()):
        with pytest.raises(NotAValue):
            encode_value(forged)
    with pytest.raises(ValueError):
        decode_value({"eval": "1"})
    meta = type("Meta", (type,), {"__eq__": lambda cls, other: True, "__hash__": type.__hash__})
    with pytest.raises(NotAValue):  # "equal" to tuple by its metaclass: still no tuple
        encode_value(meta("T", (), {})())
    crossed = [decode_value(json.loads(json.dumps(encode_value(v)))) for v in ((i for i in (1, 2)), map(abs, [-3]))]
    assert [list(v) for v in crossed] == [[1, 2], [3]] and decode_value(encode_value(range(1, 9, 2))) == range(1, 9, 2)


MBPP_SHAPES = {
    "test_list": [
        "assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
        "assert factorial(30) == 265252859812191058636308480000000",
        "assert count_chars('abca') == {'a': 2, 'b': 1, 'c': 1}",
        "assert reverse_words('hello world') == 'world hello'",
        "assert nothing() is None",
        "assert is_even(4) == True and not is_even(3)",
        "assert list(squares(3)) == [0, 1, 4]",
        "assert sorted(pairs([1, 2])) == [[1, 2], [2, 1]]",
        "assert longest_chain([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3",
        "assert abs(mean([1, 2]) - 1.5) < 1e-9",
        "assert to_bytes('a') == b'a' and halves(1) == 0.5",
    ],
    "test_setup_code": "",
}
MBPP_SHAPES_SOLUTION = """
import math
def similar_elements(a, b):
    return tuple(sorted(set(a) & set(b)))
def factorial(n):
    return math.factorial(n)
def count_chars(s):
    return {c: s.count(c) for c in dict.fromkeys(s)}
def reverse_words(s):
    return ' '.join(reversed(s.split()))
def nothing():
    pass
def is_even(n):
    return n % 2 == 0
def squares(n):
    return (i * i for i in range(n))
def pairs(xs):
    return [[x, y] for x in xs for y in xs if x != y]
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b
def longest_chain(pairs, n):
    pairs = sorted(pairs, key=lambda p: p.b)
    end, count = float('-inf'), 0
    for p in pairs:
        if p.a > end:
            end, count = p.b, count + 1
    return count
def mean(xs):
    return sum(xs) / len(xs)
def to_bytes(s):
    return s.encode()
def halves(n):
    return n / 2
"""


def test_honest_solutions_pass_mbpp_shaped_tests_of_every_kind(verifier):
    wrong = MBPP_SHAPES_SOLUTION.replace("return n % 2 == 0", "return n % 2 == 1")
    assert score(verifier, {"honest": MBPP_SHAPES_SOLUTION, "wrong": wrong}, MBPP_SHAPES) == {
        "honest": (1.0, "passed"),
        "wrong": (0.0, "wrong_answer"),
    }


# One function per expression form; every comparison, operator and function of the test's own
# (math, isinstance, type, sorted, len, set, abs, and/not) is the judge's.
FORMS = {
    "test_list": [
        "assert pi_of(1) == math.pi",
        # math is given to the solution (inside its call's input) and is still the test's afterwards
        "assert area(math.sqrt(4)) > 0 and math.isclose(area(2), 12.566370614359172)",
        "assert isinstance(as_list(1), list)",
        "assert type(double(2)) == int and double(2) == 4",
        "assert tens(11) == tens(12)",
        "assert sorted(up([3, 1])) == sorted(down([1, 3]))",
        "assert abs(half(1) - 0.5) < 1e-9",
        "assert set(uniq([1, 2, 2])) == {1, 2} and len(uniq([1, 2, 2])) == 2 and not uniq([])",
        "assert all(v > 0 for v in positives(3))",
    ],
    "test_imports": ["import math"],
}
HONEST_FORMS = {
    "pi_of": "def pi_of(x):\n    return math.pi * x",
    "area": "def area(r):\n    return math.pi * r * r",
    "as_list": "def as_list(x):\n    return [x]",
    "double": "def double(x):\n    return 2 * x",
    "tens": "def tens(x):\n    return x // 10",
    "up": "def up(xs):\n    return list(xs)",
    "down": "def down(xs):\n    return list(reversed(xs))",
    "half": "def half(x):\n    return x / 2",
    "uniq": "def uniq(xs):\n    return list(dict.fromkeys(xs))",
    "positives": "def positives(n):\n    return (i + 1 for i in range(n))",  # a generator: read out in the sandbox
}
ANY = "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"


def forms_solution(**forged: str) -> str:
    """The honest solution with some functions replaced (and module-level code added under '')."""
    functions = {**HONEST_FORMS, **forged}
    return "import math, builtins\n" + "\n".join(functions.values())


FORGED_FORMS = {
    "pi_of: an object equal to everything (== math.pi)": (
        forms_solution(pi_of=ANY + "def pi_of(x):\n    return Any()"),
        "not_a_value",
    ),
    "area: patches math.isclose": (
        forms_solution(area="math.isclose = lambda *a, **k: True\ndef area(r):\n    return 1.0"),
        "wrong_answer",
    ),
    "as_list: patches builtins.isinstance": (
        forms_solution(
            as_list="real = builtins.isinstance\n"
            "builtins.isinstance = lambda o, t: True if t is list else real(o, t)\n"
            "def as_list(x):\n    return x"
        ),
        "wrong_answer",
    ),
    "double: a class whose metaclass equals int": (
        forms_solution(
            double="class Meta(type):\n    __eq__ = lambda cls, other: True\n    __hash__ = type.__hash__\n"
            "class Four(metaclass=Meta):\n    __eq__ = lambda self, other: True\n"
            "def double(x):\n    return Four()"
        ),
        "not_a_value",
    ),
    "tens: the same object from both calls": (
        forms_solution(tens=ANY + "def tens(x):\n    return Any()"),
        "not_a_value",
    ),
    "tens: wrong (tens(11) == tens(12) is false)": (forms_solution(tens="def tens(x):\n    return x"), "wrong_answer"),
    "up/down: patches builtins.sorted": (
        forms_solution(
            up="builtins.sorted = lambda *a, **k: []\ndef up(xs):\n    return [9]",
            down="def down(xs):\n    return [8]",
        ),
        "wrong_answer",
    ),
    "half: a float whose difference is 0": (
        forms_solution(
            half="class Zero(float):\n    __sub__ = lambda self, other: 0.0\ndef half(x):\n    return Zero(7)"
        ),
        "not_a_value",
    ),
    "uniq: patches builtins.set and len": (
        forms_solution(
            uniq="builtins.set = lambda *a: {1, 2}\nbuiltins.len = lambda x: 2\ndef uniq(xs):\n    return xs or [0]"
        ),
        "wrong_answer",
    ),
    "positives: patches builtins.all": (
        forms_solution(positives="builtins.all = lambda *a: True\ndef positives(n):\n    return [-1]"),
        "wrong_answer",
    ),
}


def test_every_expression_form_is_judged_outside_the_solutions_process(verifier):
    """Each forger is honest but for one function, so each form has to hold on its own."""
    solutions = {"honest": forms_solution(), **{name: code for name, (code, _) in FORGED_FORMS.items()}}
    assert score(verifier, solutions, FORMS) == {
        "honest": (1.0, "passed"),
        **{name: (0.0, reason) for name, (_, reason) in FORGED_FORMS.items()},
    }
    sent = json.dumps([t["steps"] for t in parse_tests(FORMS)])
    for expected in ("math.pi", "isclose", "isinstance", "sorted", "12.566", "== "):
        assert expected not in sent


# Tests with state: inputs the solution changes in place, objects whose methods are called.
STATEFUL = {
    "test_list": [
        "x = [3, 1, 2]\nsort_in_place(x)\nassert x == [1, 2, 3]",
        "a = [5, 4]\nb = a\nsort_in_place(a)\nassert b == [4, 5] and len(a) == 2",
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1 and s.peek() == 1",
        "head = build([1, 2, 3])\nhead = reverse(head)\nassert to_list(head) == [3, 2, 1] and head.val == 3",
        # the solution is handed a copy: the test's own list is the judge's, whatever the solution rebinds
        "arr = [3, 1, 2]\nassert sort_copy(list(arr)) == sorted(arr)",
        "assert to_list(Solution().reverseList(build([1, 2]))) == [2, 1]",  # LeetCode's class
    ],
}
HONEST_STATEFUL = """
def sort_in_place(xs):
    xs.sort()
def sort_copy(xs):
    return sorted(xs)
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
    def peek(self):
        return self.items[-1]
    def size(self):
        return len(self.items)
class Node:
    def __init__(self, val, nxt=None):
        self.val, self.next = val, nxt
def build(values):
    head = None
    for v in reversed(values):
        head = Node(v, head)
    return head
def reverse(head):
    previous = None
    while head:
        head.next, previous, head = previous, head, head.next
    return previous
class Solution:
    def reverseList(self, head):
        return reverse(head)
def to_list(head):
    out = []
    while head:
        out.append(head.val)
        head = head.next
    return out
"""


def test_stateful_tests_are_judged_on_the_state_the_solution_left(verifier):
    forged = {
        "sorts a copy": HONEST_STATEFUL.replace("xs.sort()", "xs = sorted(xs)"),
        "rebinds the test's list to one equal to everything": HONEST_STATEFUL.replace(
            "    xs.sort()",
            "    import sys\n    class Any(list):\n        __eq__ = lambda self, other: True\n"
            "    sys._getframe(1).f_globals['x'] = Any()",
        ),
        "pop returns an object equal to everything": HONEST_STATEFUL.replace(
            "return self.items.pop()", "return type('Any', (), {'__eq__': lambda s, o: True})()"
        ),
        "a stack that forgets": HONEST_STATEFUL.replace("self.items.append(x)", "self.items = [x]"),
        "patches builtins.len": "import builtins\nbuiltins.len = lambda x: 2\n"
        + HONEST_STATEFUL.replace("xs.sort()", "pass"),
        "rebinds the test's own list to what it returns": HONEST_STATEFUL.replace(
            "return sorted(xs)", "import sys\n    sys._getframe(1).f_globals['arr'] = [9]\n    return [9]"
        ),
    }
    assert score(verifier, {"honest": HONEST_STATEFUL, **forged}, STATEFUL) == {
        "honest": (1.0, "passed"),
        "sorts a copy": (0.0, "wrong_answer"),
        "rebinds the test's list to one equal to everything": (0.0, "not_a_value"),
        "pop returns an object equal to everything": (0.0, "not_a_value"),
        "a stack that forgets": (0.0, "wrong_answer"),
        "patches builtins.len": (0.0, "wrong_answer"),
        "rebinds the test's own list to what it returns": (0.0, "wrong_answer"),
    }


def test_a_stateful_test_that_cannot_be_judged_is_refused_when_the_data_is_read(tmp_path):
    from megatron_rlvr.config import FileData, VerifierConfig
    from megatron_rlvr.data import DataError, load_data

    path = tmp_path / "stack.jsonl"
    tests = "s = Stack()\ns.push(1)\nassert len(s) == 1"
    path.write_text(json.dumps({"prompt": "write a stack", "answer": tests, "verifier": "code"}) + "\n")
    spec = FileData(path=str(path))
    spec.fill_keys()
    with pytest.raises(DataError) as refused:
        load_data(spec, VerifierConfig())
    assert str(refused.value) == (
        f"{path}:1: 'answer' holds no usable code tests: test line 3 `assert len(s) == 1`: 's' holds an object "
        "of the solution's (the test uses its methods) and is used here as a value: only what its methods return "
        "can be judged outside its process (or set data.skip_bad_rows=true to skip bad rows)"
    )
