"""Issue #37: the tests run as Python in a program-free process, the program only answers calls.

Each case of the issue, end to end through the code reward (batched: one reward call scores many
samples): the leaks of the static planner score 0 for a program that searches its whole process for the
expected value, Python's own semantics decide the forms the planner got wrong, and correct programs
score what ``python program.py && python tests.py`` gives."""

from __future__ import annotations

import textwrap
import time

import pytest

from grpo_variants.rewards import make_code_reward

from _process_finder import SEARCH


def _d(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


# A program with no arithmetic of its own (tests/_process_finder.py): it looks for the expected value everywhere in
# its process and returns what it finds, else -1. ``_search``'s argument says what the expected value would be (so a
# found value is the expected one, and nothing is found by accident).
FINDER = SEARCH + _d(
    r'''

    def add(a, b):
        found = _search(a + b, None)  # a + b only names what to look for: the value returned is the one found
        return -1 if found is None else found

    def sort_in_place(lst):
        found = _search(sorted(lst), lst)
        if found is not None:
            lst[:] = found
    '''
)
CORRECT = "def add(a, b):\n    return a + b\n\ndef sort_in_place(lst):\n    lst.sort()\n"
A, B, C = 1000003, 2000005, 3000008  # C = A + B, a number found nowhere else

LEAKS = {
    "index into a shared case": f"cases = [({A}, {B}, {C})]\nassert add(cases[0][0], cases[0][1]) == cases[0][2]",
    "comprehension over cases": f"cases = [({A}, {B}, {C})]\nassert all(add(a, b) == c for a, b, c in cases)",
    "dict case": f'case = {{"in": ({A}, {B}), "out": {C}}}\nassert add(*case["in"]) == case["out"]',
    "unpacked over statements": f"t = ({A}, {B}, {C})\na, b, c = t\nassert add(a, b) == c",
    "except-as binding": _d(f"""
        try:
            raise ValueError({C})
        except ValueError as err:
            assert add({A}, {B}) == err.args[0]
        """),
    "both sides program-side": f"data = [[{C}, {A}, {B}], [{A}, {B}, {C}]]\nsort_in_place(data[0])\n"
                               f"assert data[0] == data[1]",
    "HumanEval check(candidate)": _d(f"""
        def check(candidate):
            assert candidate({A}, {B}) == {C}
        check(add)
        """),
    "unittest": _d(f"""
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add({A}, {B}), {C})
        """),
    "table in a dict": f"table = {{({A}, {B}): {C}}}\nfor k, v in table.items():\n    assert add(*k) == v",
    "literal": f"assert add({A}, {B}) == {C}",
}


def test_a_program_searching_its_whole_process_finds_no_expected_value():
    names = sorted(LEAKS)
    planted = FINDER + f"_planted = [{C}, [{A}, {B}, {C}]]\n"  # sanity: the search finds a value really there
    completions = [FINDER] * len(names) + [CORRECT] * len(names) + [planted] * 2
    tests = [[LEAKS[n]] for n in names] * 2 + [[LEAKS["literal"]], [LEAKS["both sides program-side"]]]
    reward = make_code_reward("all")
    out = reward(prompts=["p"] * len(completions), completions=completions, tests=tests)
    n = len(names)
    assert out[:n] == [0.0] * n, {k: (s, r) for k, s, r in zip(names, out, reward.last_reasons) if s}
    assert out[n:2 * n] == [1.0] * n, {k: r for k, s, r in zip(names, out[n:], reward.last_reasons[n:]) if s != 1}
    assert out[2 * n:] == [1.0, 1.0], reward.last_reasons[2 * n:]


# (program, tests, Python's verdict): names the tests bind themselves, chained comparisons, values the
# planner could not carry.
PYTHON = {
    "star import (hack)": ("def f(x):\n    return 1\ndef sqrt(x):\n    return 1\n",
                           "from math import *\nassert f(16) == sqrt(16)", 0.0),
    "star import (correct)": ("def f(x):\n    return 4.0\n", "from math import *\nassert f(16) == sqrt(16)", 1.0),
    "global in a helper (hack)": ("N = 1\ndef f(x):\n    return 2\n",
                                  "def setup():\n    global N\n    N = 5\nsetup()\nassert f(N) == 2 * N", 0.0),
    "global in a helper (correct)": ("def f(x):\n    return 2 * x\n",
                                     "def setup():\n    global N\n    N = 5\nsetup()\nassert f(N) == 2 * N", 1.0),
    "match capture (hack)": ("a = b = 0\ndef add(x, y):\n    return 0\n",
                             "match (3, 4):\n    case (a, b):\n        assert add(a, b) == 7", 0.0),
    "match capture (correct)": (CORRECT, "match (3, 4):\n    case (a, b):\n        assert add(a, b) == 7", 1.0),
    "exec (hack)": ("E = 0\ndef add(a, b):\n    return 0\n", 'exec("E = 7")\nassert add(3, 4) == E', 0.0),
    "exec (correct)": (CORRECT, 'exec("E = 7")\nassert add(3, 4) == E', 1.0),
    "impossible chain": ("n = [0]\ndef pick():\n    n[0] += 1\n    return 4 if n[0] % 2 else 1\n",
                         "assert 3 < pick() < 2", 0.0),
    "10**5000": ("def big():\n    return 10 ** 5000\n", "assert big() == 10 ** 5000", 1.0),
    "Counter": ("from collections import Counter\ndef count(s):\n    return Counter(s)\n",
                'from collections import Counter\nassert count("abca") == Counter({"a": 2, "b": 1, "c": 1})', 1.0),
    "dict.keys()": ('def keys():\n    return {"a": 1, "b": 2}.keys()\n', 'assert keys() == {"a", "b"}', 1.0),
    "Fraction": ("from fractions import Fraction\ndef half():\n    return Fraction(1, 2)\n",
                 "from fractions import Fraction\nassert half() == Fraction(2, 4)", 1.0),
    "in range": ("def pick():\n    return 7\n", "assert pick() in range(10)", 1.0),
    "push returns its list": ("def push(lst, x):\n    lst.append(x)\n    return lst\n",
                              "lst = [1]\nassert push(lst, 3) == lst\nassert lst == [1, 3]", 1.0),
    "unittest (correct)": (CORRECT, _d("""
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(1, 2), 3)
            def test_sort(self):
                x = [2, 1]
                sort_in_place(x)
                self.assertEqual(x, [1, 2])
        if __name__ == "__main__":
            unittest.main()
        """), 1.0),
    "unittest (wrong)": ("def add(a, b):\n    return a - b\n", _d("""
        import unittest
        class T(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(1, 2), 3)
        """), 0.0),
    "an object of the program is never compared": (
        ("class Always:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
         "def f():\n    return Always()\n"), "assert f() == 3", 0.0),
    "a handle's methods go to the program": (
        ("class Stack:\n    def __init__(self):\n        self.x = []\n    def push(self, v):\n        self.x.append(v)\n"
         "    def pop(self):\n        return self.x.pop()\n"),
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert len(s.x) == 1", 1.0),
    "the program's import math serves the tests": ("import math\ndef f(x):\n    return math.sqrt(x)\n",
                                                    "assert math.isclose(f(4), 2.0)", 1.0),
    "a module under another name stays the program's": ("import os as math\ndef f(x):\n    return 2.0\n",
                                                         "assert math.floor(f(4)) == 2", 0.0),
    "pytest style (correct)": (CORRECT, "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n", 1.0),
    "pytest style (wrong)": ("def add(a, b):\n    return 0\n",
                             "from solution import add\n\ndef test_add():\n    assert add(1, 2) == 3\n", 0.0),
    "a program's builtin stays the program's": ("def sorted(x):\n    return [0]\ndef f(x):\n    return [0]\n",
                                                "x = [3, 1]\nassert f(x) == sorted(x)", 0.0),
    "except what the program raises": ("def f(x):\n    raise ValueError('no')\n",
                                       "try:\n    f(1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok",
                                       1.0),
}


def test_python_decides_every_form():
    names = sorted(PYTHON)
    reward = make_code_reward("all")
    out = reward(prompts=["p"] * len(names), completions=[PYTHON[n][0] for n in names],
                 tests=[[PYTHON[n][1]] for n in names])
    got = dict(zip(names, out))
    want = {n: PYTHON[n][2] for n in names}
    assert got == want, {n: reward.last_reasons[i] for i, n in enumerate(names) if got[n] != want[n]}


def test_partial_credit_per_test_and_what_is_refused():
    tests = _d("""
        assert add(1, 2) == 3
        assert add(2, 2) == 5
        import unittest
        class T(unittest.TestCase):
            def test_a(self):
                self.assertEqual(add(0, 0), 0)
            def test_b(self):
                self.assertEqual(add(1, 1), 3)
        """)
    frac = make_code_reward("fraction")
    assert frac(prompts=["p"], completions=[CORRECT], tests=[[tests, {"input": "", "output": "hi"}]]) == [2 / 5]
    # A test that passes the program a function of the tests' own is refused (code never crosses).
    refused = ["assert add(1, 2) == 3", "assert add(lambda: 1, 2) == 3"]
    with pytest.raises(Exception, match="unsupported test"):
        make_code_reward("all")(prompts=["p"], completions=[CORRECT], tests=[refused])
    fail = make_code_reward("fraction", on_unsupported="fail")
    assert fail(prompts=["p"], completions=[CORRECT], tests=[refused]) == [0.5] and fail.last_unsupported == 1
    skip = make_code_reward("fraction", on_unsupported="skip")
    assert skip(prompts=["p"], completions=[CORRECT], tests=[refused]) == [1.0]


def test_the_trainer_waits_no_longer_than_the_slowest_budget_plus_1s_whatever_the_program_does():
    """The bound of a reward call (its completions fit in the workers): the slowest completion's budget
    (``max(last_budgets)``, the program's own-time limit) plus 1 s, whatever the programs do. Each program's
    sandbox starts beside the tests' processes and is killed once its budget is spent; the 1 s is what is
    left: the kill and the sandboxes' teardown (0.2-0.35 s measured at load average 3-8 on 2 cores). No
    slack for load beyond it: the budgets are multiples of a sandbox start-up measured in the same call, so
    they grow with the load themselves. The tests' own time is not in the budget: a test that never ends is
    stopped at ``timeout`` (the ceiling of everything), and the call then returns within timeout + 1 s."""
    hang = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef add(a, b):\n    time.sleep(60)\n"
    busy = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef add(a, b):\n    while True:\n        pass\n"
    busy_at_import = "while True:\n    pass\n"
    closes_its_pipes = "import os\nfor fd in range(3, 64):\n    try:\n        os.close(fd)\n    except OSError:\n" \
                       "        pass\ndef add(a, b):\n    return a + b\n"
    completions = [hang, busy, busy_at_import, closes_its_pipes, CORRECT]
    reward = make_code_reward("all", max_workers=len(completions), time_factor=2.0, min_timeout=0.5)
    t = time.monotonic()
    out = reward(prompts=["p"] * 5, completions=completions, tests=[["assert add(1, 2) == 3"]] * 5)
    took = time.monotonic() - t
    assert out == [0.0, 0.0, 0.0, 0.0, 1.0], reward.last_reasons
    budget = max(reward.last_budgets)
    assert budget < 10.0 and took <= budget + 1.0, (took, reward.last_budgets)
    assert all("budget" in r[0] or "sent no result" in r[0] for r in reward.last_reasons[:3]), reward.last_reasons
    # Tests that never end (trusted, but wrong): stopped at the 2 s timeout, not the 10 s the test asks.
    ceiling = make_code_reward("all", timeout=2.0)
    t = time.monotonic()
    assert ceiling(prompts=["p"], completions=[CORRECT], tests=[["import time\ntime.sleep(10)"]]) == [0.0]
    took = time.monotonic() - t
    assert took <= 2.0 + 1.0 and "ran past the timeout" in ceiling.last_reasons[0][0], (took, ceiling.last_reasons)
    # A budget that is the whole timeout (time_factor=None) ends when the tests' time does: the tests' process
    # still hears that the program is gone and reports it (not a failed tests' process, which was replaced).
    whole = make_code_reward("all", time_factor=None, timeout=1.5, max_workers=2)
    t = time.monotonic()
    assert whole(prompts=["p"] * 2, completions=[busy, busy_at_import], tests=[["assert add(1, 2) == 3"]] * 2) == [0.0] * 2
    took = time.monotonic() - t
    assert took <= 1.5 + 1.0, took
    assert all(len(r) == 1 and ("budget of 1.50 s (timeout)" in r[0] or "stopped at the timeout (1.5 s" in r[0])
               for r in whole.last_reasons), whole.last_reasons
