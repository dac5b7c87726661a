"""Issue #37: for random test files in the supported styles, the judge's verdict is Python's verdict.

Styles: asserts, HumanEval, unittest, tables in lists, dicts and comprehensions, and a linked list of a
node class the test file defines, sorted in place. Python's verdict is what ``python tests.py`` says (the
tests importing the program's names: ``from program import *``) run for real in a temporary directory;
the judge's is ``code_pass`` (mode "all").
Twenty seeded files, each against a correct program and a program wrong on one input (which a file may
or may not exercise), scored in one reward call."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest

from grpo_variants.rewards import make_code_reward

# h sorts a linked list's values in place (LeetCode style: the test file defines the node class).
H = ("def h(head):\n    nodes = []\n    while head:\n        nodes.append(head)\n        head = head.next\n"
     "    for n, v in zip(nodes, {}(n.val for n in nodes){}):\n        n.val = v\n")
CORRECT = "def f(a, b):\n    return 2 * a + b\n\ndef g(xs):\n    return sorted(xs)\n" + H.format("sorted", "")


def _wrong(rng: random.Random) -> str:
    k = rng.randrange(10)
    bug = rng.choice([f"    if a == {k}:\n        return 2 * a + b + 1\n",
                      f"    if a == {k}:\n        raise ValueError(a)\n"])
    return (f"def f(a, b):\n{bug}    return 2 * a + b\n\ndef g(xs):\n    return sorted(xs)[:{k % 3 + 3}]\n"
            + H.format("list", f"[::{-1 if k % 2 else 1}]"))  # reversed, or left as it is


def _tests(rng: random.Random) -> str:
    ins = [(rng.randrange(10), rng.randrange(10)) for _ in range(rng.randint(1, 4))]
    outs = [2 * a + b for a, b in ins]
    xs = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    style = rng.choice(["assert", "humaneval", "unittest", "list", "dict", "comprehension", "nodes"])
    if style == "assert":
        body = "".join(f"assert f({a}, {b}) == {e}\n" for (a, b), e in zip(ins, outs))
        return body + f"xs = {xs}\nassert g(xs) == sorted(xs)\n"
    if style == "humaneval":
        body = "".join(f"    assert candidate({a}, {b}) == {e}\n" for (a, b), e in zip(ins, outs))
        return f"def check(candidate):\n{body}\ncheck(f)\n"
    if style == "unittest":
        meths = "".join(f"    def test_{i}(self):\n        self.assertEqual(f({a}, {b}), {e})\n"
                        for i, ((a, b), e) in enumerate(zip(ins, outs)))
        return (f"import unittest\n\nclass T(unittest.TestCase):\n{meths}"
                f"    def test_g(self):\n        self.assertListEqual(g({xs}), {sorted(xs)})\n\n"
                "if __name__ == '__main__':\n    unittest.main()\n")
    if style == "list":
        cases = [(a, b, e) for (a, b), e in zip(ins, outs)]
        return f"cases = {cases}\nfor a, b, e in cases:\n    assert f(a, b) == e\n"
    if style == "dict":
        table = {(a, b): e for (a, b), e in zip(ins, outs)}
        return f"table = {table}\nassert all(f(*k) == v for k, v in table.items())\n"
    if style == "nodes":
        return ("class ListNode:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
                "def build(xs):\n    head = None\n    for x in reversed(xs):\n        head = ListNode(x, head)\n"
                "    return head\ndef values(head):\n    out = []\n    while head:\n        out.append(head.val)\n"
                f"        head = head.next\n    return out\nhead = build({xs})\nh(head)\n"
                f"assert values(head) == {sorted(xs)}\n")
    return f"ins = {ins}\nouts = {outs}\nassert [f(a, b) for a, b in ins] == outs\n"


def _python_verdict(tmp_path, i: int, program: str, tests: str) -> float:
    d = tmp_path / str(i)
    d.mkdir()
    (d / "program.py").write_text(program)
    (d / "tests.py").write_text("from program import *\n" + tests)
    ok = subprocess.run([sys.executable, "program.py"], cwd=d, capture_output=True, timeout=60).returncode == 0
    ok = ok and subprocess.run([sys.executable, "tests.py"], cwd=d, capture_output=True, timeout=60).returncode == 0
    return 1.0 if ok else 0.0


@pytest.mark.parametrize("seed", [37])
def test_judge_verdict_is_pythons_verdict(tmp_path, seed):
    rng = random.Random(seed)
    files = [_tests(rng) for _ in range(20)]
    programs = [CORRECT] * len(files) + [_wrong(rng) for _ in files]
    files = files * 2
    want = [_python_verdict(tmp_path, i, p, t) for i, (p, t) in enumerate(zip(programs, files))]
    assert 0.0 in want and want.count(1.0) > len(files) // 2  # both verdicts occur: the property is not vacuous
    reward = make_code_reward("all")
    got = reward(prompts=["p"] * len(files), completions=programs, tests=[[t] for t in files])
    bad = [(textwrap.shorten(p, 80), t, w, g, reward.last_reasons[i])
           for i, (p, t, w, g) in enumerate(zip(programs, files, want, got)) if w != g]
    assert not bad, bad
