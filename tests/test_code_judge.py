"""Issue #25: expected values never reach the program, the trainer survives any output, runs do not
disturb each other. The attacks of the red team, written as tests.

The first half needs no sandbox (the judge's split, the decoder, extract_code, the seccomp program);
the second half runs programs (a handful of reward calls, batched)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from grpo_variants.errors import ConfigError
from grpo_variants.rewards import harness, make_code_reward, run_in_sandbox, sandbox_capabilities
from grpo_variants.rewards import seccomp
from grpo_variants.rewards.builtin import extract_code

REPO = Path(__file__).resolve().parents[1]


def _dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


# ---------------------------------------------------------------------------------------------
# 1. The judge's invariant: what the program's process holds
# ---------------------------------------------------------------------------------------------
SECRET_TESTS = [
    # tests whose expected side holds 31337 (the old planner's split cases, now run by Python)
    "assert add(1, 2) == sum([1, 2, 31337])",
    "expected = 31337\nassert add(1, 2) == expected",
    "def _ref(a, b):\n    return a + b + 31337\nassert add(2, 2) == _ref(2, 2)",
    "x = [3, 1, 2]\nwant = sorted(x) + [31337]\nassert f(x) == want",
    "import math\nassert abs(f(2) - math.pi * 31337) < 1e-6",
    "import math\nassert math.isclose(f(2), 31337.5, rel_tol=1e-9)",
    "assert f(1) == 31337 and g(2) != 31338",
    "from collections import OrderedDict\nassert f() == OrderedDict([(31337, 1)])",
    "orig = [3, 1, 2]\nlst = list(orig)\nsort_in_place(lst)\nassert lst == sorted(orig) + [31337][:0]",
]
# Every function of this program looks for 31337 in its whole process and says in its exception's message
# whether it found it (the message is all that comes back of a raise).
SNIFFER = _dedent(
    r"""
    import gc, os, sys
    T = 31336 + 1  # not a constant of the code: only a value made at run time is found
    def _sniff(*_a, **_k):
        hit = any(T == v and v is not T for o in gc.get_objects() if isinstance(o, (list, tuple, dict))
                  for v in (o.values() if isinstance(o, dict) else o) if type(v) is int)
        for fd in range(256):
            try:
                os.set_blocking(fd, False)
                hit = hit or str(T).encode() in os.read(fd, 1 << 20)
            except Exception:
                pass
        raise ValueError("LEAKED" if hit else "clean")
    add = f = g = sort_in_place = _sniff
    """
)


def test_program_process_holds_no_expected_side():
    reward = make_code_reward("fraction")
    planted = SNIFFER + "PLANT = [int('31337')]\n"
    n = len(SECRET_TESTS)
    out = reward(prompts=["p"] * (n + 1), completions=[SNIFFER] * n + [planted],
                 tests=[[t] for t in SECRET_TESTS] + [[SECRET_TESTS[1]]])
    assert out == [0.0] * (n + 1)
    for tests, reasons in zip(SECRET_TESTS, reward.last_reasons[:n]):
        assert any("ValueError: clean" in r for r in reasons) and not any("LEAKED" in r for r in reasons), \
            (tests, reasons)
    assert "LEAKED" in reward.last_reasons[n][0]  # sanity: the sniffer finds a 31337 that is really there


# The old planner refused these (marked unsupported); Python now decides them, for a correct and a wrong program.
PYTHON_DECIDES = [
    ("inp, exp = (1, 2), 3\nassert f(*inp) == exp", "def f(a, b):\n    return a + b\n"),
    ("e = 3\nassert f(1) - e == 0", "def f(x):\n    return x + 2\n"),
    ("def check(r):\n    return r == 42\nassert check(f(1))", "def f(x):\n    return 42\n"),
    ("assert all(f(i) == i for i in range(3))", "def f(x):\n    return x\n"),
    ("for i in range(3):\n    assert f(i) == i", "def f(x):\n    return x\n"),
    ("assert f(1) is None", "def f(x):\n    return None\n"),
    ("assert add(1, 2) == add(2, 1)", "def add(a, b):\n    return a + b\n"),
]


def test_forms_the_planner_refused_are_decided_by_python():
    wrong = "def f(*a):\n    return 7\ndef add(a, b):\n    return a - b\n"
    n = len(PYTHON_DECIDES)
    reward = make_code_reward("all")
    out = reward(prompts=["p"] * 2 * n, completions=[p for _, p in PYTHON_DECIDES] + [wrong] * n,
                 tests=[[t] for t, _ in PYTHON_DECIDES] * 2)
    assert out == [1.0] * n + [0.0] * n, reward.last_reasons


def test_mutation_through_the_program_is_seen_and_expected_sides_are_not_moved():
    tests = "orig = [3, 1, 2]\nlst = list(orig)\nsort_in_place(lst)\nassert lst == sorted(orig)\nassert orig == [3, 1, 2]"
    alias = "a = [2, 1]\nb = a\nsort_in_place(b)\nassert a == [1, 2]"
    later = "lst = [2, 1]\nassert sort_in_place(lst) is None\nassert lst == [1, 2]"
    good = "def sort_in_place(x):\n    x.sort()\n"
    bad = "def sort_in_place(x):\n    return sorted(x)\n"  # sorts a copy: the test's list stays as it was
    reward = make_code_reward("fraction")
    out = reward(prompts=["p"] * 6, completions=[good] * 3 + [bad] * 3, tests=[[tests], [alias], [later]] * 2)
    assert out == [1.0, 1.0, 1.0, 0.5, 0.0, 0.0], reward.last_reasons


def test_unsupported_is_an_error_a_failure_or_skipped_and_always_logged(caplog):
    from grpo_variants.errors import DatasetError

    tests = [["assert f(1) == 2", "assert f(lambda: 1) == 2"]]  # a function of the tests never crosses
    prog = ["def f(x):\n    return 2 * x\n"]
    with pytest.raises(DatasetError, match="unsupported test"):
        make_code_reward("all")(prompts=["p"], completions=prog, tests=tests)
    fail = make_code_reward("fraction", on_unsupported="fail")
    with caplog.at_level("WARNING"):
        assert fail(prompts=["p"], completions=prog, tests=tests) == [0.5]
    assert fail.last_unsupported == 1 and any("unsupported test" in r for r in fail.last_reasons[0])
    assert "unsupported test" in caplog.text
    skip = make_code_reward("all", on_unsupported="skip")
    assert skip(prompts=["p"], completions=prog, tests=tests) == [1.0]
    assert skip(prompts=["p"], completions=prog, tests=[tests[0][1:]]) == [None]  # nothing left to judge
    assert skip(prompts=["p"], completions=prog, tests=[["assert f(1 ==="]]) == [None]  # does not parse


# ---------------------------------------------------------------------------------------------
# Agreement with Python's assert, case by case (values after crossing)
# ---------------------------------------------------------------------------------------------
AGREE = [
    (OrderedDict([("a", 1), ("b", 2)]), "==", OrderedDict([("b", 2), ("a", 1)])),
    (OrderedDict([("a", 1), ("b", 2)]), "==", {"b": 2, "a": 1}),
    ({"a": 1, "b": 2}, "==", {"b": 2, "a": 1}),
    ({1, 2}, "==", {1.0, 2.0}),
    ({True}, "==", {1}),
    ({(1, 2), (3,)}, "==", {(1.0, 2), (3,)}),
    ({frozenset({1, 2})}, "==", {frozenset({2, 1})}),
    ({1: "a"}, "==", {1.0: "a"}),
    ([1, 2], "==", (1, 2)),
    ((1, [2]), "==", (1, [2])),
    ("ab", "==", b"ab"),
    (1, "==", 1.0),
    (float("nan"), "==", float("nan")),
    (complex(1, 0), "==", 1),
    (complex(1, 2), "==", complex(1, 2)),
    (2, "in", {1, 2}),
    (2.0, "in", {1: "x", 2: "y"}),
    ([1], "in", [[1], [2]]),
    ({1}, "in", [{1.0}]),
    ("b", "in", "abc"),
    ({1}, "<", {1, 2}),
    ([1, 2], "<", [1, 3]),
    ({1, 2}, "!=", {1, 2, 3}),
    (-0.0, "==", 0),
    (float("inf"), ">", 10 ** 300),
    (10 ** 400, "==", 10 ** 400),
]


def _python(a, op, b):
    return {"==": lambda: a == b, "!=": lambda: a != b, "<": lambda: a < b, ">": lambda: a > b,
            "in": lambda: a in b}[op]()


@pytest.mark.parametrize("a,op,b", AGREE, ids=[f"{i}" for i in range(len(AGREE))])
def test_verdict_agrees_with_pythons_assert(a, op, b):
    def cross(v):
        return harness.decode(json.loads(json.dumps(harness.encode(v, harness._refuse_other))), lambda i: i)

    assert _python(cross(a), op, b) == _python(a, op, b)  # the program's value, compared by Python as it was


# ---------------------------------------------------------------------------------------------
# 2. A decoder that cannot fail or stall; extract_code in linear time
# ---------------------------------------------------------------------------------------------
def test_forged_answers_cannot_fail_the_decoder():
    """What a program may send back: each forged value is refused with an exception (its test fails)."""
    big = int("9" * 400)
    forged = [
        f'{{"c": [{big}, 0]}}',                       # OverflowError in complex()
        '{"s": [[1], [2]]}',                          # unhashable set element
        "[" * 5000 + "]" * 5000,                      # deeper than the bound
        '{"d": [[{"d": []}, 1]]}',                    # a dict as a key
        '{"b": "zz"}',
        '{"t": 1}',
        "[" + ",".join(["[]"] * 250_000) + "]",       # past the element budget
        '{"h": "0"}',
    ]
    for text in forged:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            continue  # json itself refuses it: the stub's call raises, its test fails
        with pytest.raises((ValueError, TypeError, OverflowError, RecursionError)):
            harness.decode(obj, lambda i: i)


def test_colliding_set_is_refused_in_linear_time():
    """~39,000 integers that all hash alike in Python (multiples of 2**61 - 1) used to take 20-40 s to build."""
    mod = (1 << 61) - 1
    t = time.process_time()
    with pytest.raises(ValueError, match="hash alike"):
        harness.decode({"s": [k * mod for k in range(39_000)]}, lambda i: i)
    assert time.process_time() - t < 3.0


ADVERSARIAL = {
    "fence, no newline": "```" + "a" * 1_000_000,
    "fences, no newline": "``` " * 250_000,
    "backticks": "`" * 1_000_000,
    "open fences": "```x\n" * 200_000,
    "long line then fence": "a" * 999_990 + "\n```py\n",
    "degenerate collapse": ("``` ``python ``" * 70_000)[:1_000_000],
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_extract_code_is_linear_on_adversarial_text(name):
    text = ADVERSARIAL[name]
    t = time.process_time()
    extract_code(text)
    assert time.process_time() - t < 2.0, name  # the old regex took 21-29 s on 148 kB


def test_extract_code_semantics_kept():
    assert extract_code("text\n```python\na=1\n```\nmore\n```python\nb=2\n```") == "b=2\n"
    assert extract_code("```\nc=3\n```") == "c=3\n"
    assert extract_code("```js\nx\n```\n```py\nd=4\n```") == "d=4\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```python\ntruncated = 1") == "truncated = 1"
    assert extract_code("```x ```y\ncode```") == "code"
    assert extract_code("") == "" and extract_code(None) == ""


# ---------------------------------------------------------------------------------------------
# 5. The seccomp program
# ---------------------------------------------------------------------------------------------
def test_seccomp_program_shape():
    for arch in ("x86_64", "aarch64"):
        prog = seccomp.build_filter(machine=arch)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 < 4096
        ins = [struct.unpack("<HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert ins[0] == (0x20, 0, 0, 4)  # load the architecture first
        assert ins[-1] == (0x06, 0, 0, seccomp.RET_ALLOW) and ins[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS)
        nums = seccomp.syscall_numbers(arch)
        for name in ("io_uring_setup", "userfaultfd", "keyctl", "add_key", "request_key", "bpf",
                     "perf_event_open", "ptrace", "mount", "unshare", "setns"):
            assert (0x15, 0, 1, nums[name]) in ins, (arch, name)
    assert seccomp.build_filter(machine="mips") is None
    assert len(seccomp.build_filter(network=True)) > len(seccomp.build_filter())


_SECCOMP_PROBE = r'''
import ctypes, json, socket, subprocess, threading, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NUMS = %r
res = {}
for name, nr in NUMS.items():
    if name in ("socket", "socketpair", "clone", "clone3", "reboot", "vhangup"):
        continue
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(0)] * 5)
    res[name] = ctypes.get_errno() if r == -1 else "ok"
for fam in (40, 16, 17, 2, 10, 3):  # AF_VSOCK, AF_NETLINK, AF_PACKET, AF_INET, AF_INET6, AF_AX25
    try:
        socket.socket(fam, socket.SOCK_RAW if fam in (16, 17) else socket.SOCK_STREAM).close()
        res["af%%d" %% fam] = "ok"
    except OSError as e:
        res["af%%d" %% fam] = e.errno
ctypes.set_errno(0)
r = libc.syscall(ctypes.c_long(NUMS["clone"]), ctypes.c_long(0x10000000 | 17), *[ctypes.c_long(0)] * 4)
if r == 0:
    os._exit(0)
res["clone(CLONE_NEWUSER)"] = ctypes.get_errno() if r == -1 else "ok"
ctypes.set_errno(0)
r = libc.syscall(ctypes.c_long(NUMS["clone3"]), *[ctypes.c_long(0)] * 2)
res["clone3"] = ctypes.get_errno() if r == -1 else "ok"
ok = {"fork+exec": subprocess.run(["/bin/echo", "x"], capture_output=True).stdout.decode().strip() == "x"}
t = threading.Thread(target=lambda: None); t.start(); t.join(); ok["thread"] = True
a, b = socket.socketpair(); a.close(); b.close(); ok["unix socketpair"] = True
print(json.dumps({"denied": res, "ok": ok}))
'''


@pytest.mark.skipif(not sandbox_capabilities().get("seccomp"), reason="no seccomp filter here (announced at start)")
def test_seccomp_denies_each_call_with_eperm():
    r = run_in_sandbox(_SECCOMP_PROBE % seccomp.syscall_numbers(), timeout=30)
    assert r.ok, r.stderr[-2000:]
    out = json.loads(r.stdout)
    wrong = {k: v for k, v in out["denied"].items() if v != (38 if k == "clone3" else 1)}
    assert not wrong, wrong  # EPERM everywhere (clone3: ENOSYS, so libc falls back to clone)
    assert all(out["ok"].values()), out["ok"]


# ---------------------------------------------------------------------------------------------
# Reward calls with hostile programs
# ---------------------------------------------------------------------------------------------
READER = _dedent(
    r'''
    import builtins, gc, os, re, sys
    SEEN = []
    def _tracer(frame, event, arg):
        try:
            SEEN.append(dict(frame.f_locals))
            SEEN.append(dict(frame.f_globals))
        except Exception:
            pass
        return _tracer
    sys.settrace(_tracer)
    sys.setprofile(lambda frame, event, arg: SEEN.append(dict(frame.f_locals)))
    for _name in ("sum", "sorted", "len", "abs"):
        _real = getattr(builtins, _name)
        def _spy(*a, _real=_real, **k):
            v = _real(*a, **k)
            SEEN.append(v)
            return v
        setattr(builtins, _name, _spy)
    def _candidates():
        import __main__
        sys.settrace(None)
        sys.setprofile(None)
        yield from list(SEEN)
        yield vars(__main__)
        frame = sys._getframe()
        while frame is not None:
            yield frame.f_globals
            yield frame.f_locals
            frame = frame.f_back
        yield from gc.get_objects()
        for path in ("main.py", "/proc/self/cmdline", "/proc/1/cmdline", "/proc/self/environ"):
            try:
                yield open(path, errors="replace").read()
            except OSError:
                pass
    def _steal(own):
        """Any int/str that looks like an answer: values of names like expected/_ref, or of another probe."""
        for obj in _candidates():
            if isinstance(obj, dict):
                for k in ("expected", "want", "EXPECTED"):
                    if isinstance(obj.get(k), int):
                        return obj[k]
                for k, v in list(obj.items()):
                    if callable(v) and getattr(v, "__name__", "") == "_ref":
                        return v(*own)
            if isinstance(obj, (list, tuple)):
                for s in obj:
                    if isinstance(s, (list, tuple)) and len(s) == 3 and s[0] == "p" and "add" not in str(s[2]):
                        try:
                            return eval(s[2], sys._getframe(1).f_globals)
                        except Exception:
                            pass
            if isinstance(obj, str):
                m = re.search(r"add\(%d, %d\) == (\d+)" % own, obj)
                if m:
                    return int(m.group(1))
        return -1
    def add(a, b):
        return _steal((a, b))
    '''
)
CORRECT_ADD = "def add(a, b):\n    return a + b\n"
READER_TESTS = [
    "assert add(1, 2) == sum([1, 2])",
    "expected = 7\nassert add(3, 4) == expected",
    "def _ref(a, b):\n    return a + b\nassert add(5, 6) == _ref(5, 6)",
    "assert add(20, 22) == 42",
]


def test_reading_expected_values_by_every_route_scores_zero():
    reward = make_code_reward("fraction")
    planted = READER + "expected = 3\n"  # sanity: the search finds a value that is really there
    out = reward(prompts=["p"] * 3, completions=[READER, CORRECT_ADD, planted], tests=[READER_TESTS] * 3)
    assert out[0] == 0.0 and out[1] == 1.0, (out, reward.last_reasons)
    assert out[2] > 0.0  # the planted value answers add(1, 2)


HOSTILE = _dedent(
    r'''
    import json, os, sys, time
    # forged records on every descriptor, a colliding set, a complex past float range
    mod = (1 << 61) - 1
    forged = "\n".join(
        "grpo-judge-%016x " % k + json.dumps({"i": i, "v": v}) for k in range(3) for i in range(4)
        for v in ({"c": [int("9" * 400), 0]}, {"s": [j * mod for j in range(2000)]}, 3))
    for fd in range(1, 10):
        try:
            os.write(fd, forged.encode())
        except OSError:
            pass
    # spinners in new sessions, a flood, then a stall
    for _ in range(6):
        if os.fork() == 0:
            os.setsid()
            while True:
                pass
    try:
        os.kill(-1, 9)
    except OSError:
        pass
    sys.stderr.write("x" * 100_000)
    while True:
        pass
    '''
)


def test_one_hostile_beside_seven_correct_all_correct_score_one():
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == sum([2, 2])", "x = [1, 2]\nassert add(*x) == 3"]
    reward = make_code_reward("all", timeout=5.0)
    completions = [HOSTILE] + [CORRECT_ADD] * 7
    t = time.monotonic()
    out = reward(prompts=["p"] * 8, completions=completions, tests=[tests] * 8)
    assert out == [0.0] + [1.0] * 7, (out, reward.last_reasons)
    assert time.monotonic() - t < 60


def test_one_wall_clock_budget_per_completion():
    sleepy = "import time\ntime.sleep(1.0)\nprint(input())\n"
    cases = {"inputs": [f"{i}\n" for i in range(6)], "outputs": [f"{i}\n" for i in range(6)]}
    reward = make_code_reward("fraction", timeout=2.5)
    t = time.monotonic()
    out = reward(prompts=["p"], completions=[sleepy], tests=[cases])
    took = time.monotonic() - t
    assert took < 2.5 + 3.0, took  # not 6 x 2.5 s
    assert out[0] < 1.0 and any("timeout" in r for r in reward.last_reasons[0])


def test_a_completions_budget_is_a_multiple_of_a_program_free_run():
    # The default limit: time_factor x the program-free run's time, at least min_timeout, at most timeout.
    reward = make_code_reward("all")
    t = time.monotonic()
    out = reward(prompts=["p"] * 2, completions=["while True:\n    pass\n", CORRECT_ADD],
                 tests=[["assert add(1, 2) == 3"]] * 2)
    took = time.monotonic() - t
    assert out == [0.0, 1.0], reward.last_reasons
    budget = reward.last_budgets[0]
    assert reward.last_budgets[0] == reward.last_budgets[1] and 0.5 <= budget < 10.0
    assert took < budget + 3.0, (took, budget)  # the stall is cut at its budget, not at timeout=10 s
    assert any("time_factor" in r and f"{budget:.2f} s" in r for r in reward.last_reasons[0])
    # time_factor=None: the whole timeout, as before the relative limit.
    whole = make_code_reward("all", time_factor=None, timeout=1.5)
    assert whole(prompts=["p"], completions=[CORRECT_ADD], tests=[["assert add(1, 2) == 3"]]) == [1.0]
    assert whole.last_budgets == [1.5]


def test_the_tests_time_is_not_the_programs():
    # The program's budget counts its start-up and its answers only: a test whose own side is slow (a reference
    # implementation called in the test) costs the program nothing; a slow program is cut at its budget.
    slow_add = "import time\ndef add(a, b):\n    time.sleep(4)\n    return a + b\n"
    costly = "import time\ndef _ref():\n    time.sleep(3)\n    return 3\nassert add(1, 2) == _ref()"
    reward = make_code_reward("all", time_factor=2.0, min_timeout=0.3)
    out = reward(prompts=["p"] * 2, completions=[CORRECT_ADD, slow_add], tests=[[costly], ["assert add(1, 2) == 3"]])
    assert out == [1.0, 0.0], reward.last_reasons
    assert reward.last_budgets[0] < 3.0 and "time_factor" in reward.last_reasons[1][0]


def test_an_explicit_timeout_is_said_to_be_a_ceiling(caplog):
    reward = make_code_reward("all", timeout=3.0)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert reward(prompts=["p"], completions=[CORRECT_ADD], tests=[["assert add(1, 2) == 3"]]) == [1.0]
    assert caplog.text.count("ceiling") == 1 and "time_factor=None" in caplog.text
    assert reward.last_budgets[0] < 3.0


@pytest.mark.parametrize("bad", [{"time_factor": 0.5}, {"time_factor": "4"}, {"time_factor": float("nan")},
                                 {"min_timeout": 0}, {"min_timeout": True}])
def test_bad_time_limits_are_refused(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        make_code_reward("all", **bad)


def test_a_reference_run_past_the_timeout_fails_its_tests_and_is_said(caplog):
    # The tests' own side cannot finish within the timeout: its tests fail (not the program's fault, said so),
    # and the next call starts afresh.
    slow = "import time\ndef _slow():\n    time.sleep(3)\n    return 3\nassert add(1, 2) == _slow()"
    quick = make_code_reward("all", timeout=1.5, test_timeout=10)
    with caplog.at_level("WARNING"):
        assert quick(prompts=["p"], completions=[CORRECT_ADD], tests=[[slow]]) == [0.0]
    assert "reference run" in caplog.text and "not the program's fault" in quick.last_reasons[0][-1]
    # Within one call the failed tests' process is replaced: the next completion is judged by a fresh one.
    one = make_code_reward("all", timeout=1.5, test_timeout=10, max_workers=1)
    assert one(prompts=["p"] * 2, completions=[CORRECT_ADD] * 2, tests=[[slow], ["assert add(1, 2) == 3"]]) == \
        [0.0, 1.0], one.last_reasons
    quick.sandbox_options["timeout"] = 10.0
    quick._pool = None
    assert quick(prompts=["p"], completions=[CORRECT_ADD], tests=[[slow]]) == [1.0]


def test_uid_locks_are_machine_wide(monkeypatch, tmp_path):
    from grpo_variants.rewards import sandbox as sb

    monkeypatch.setenv("GRPO_SANDBOX_LOCK_DIR", str(tmp_path / "locks"))
    first = sb._uid_lock_dir()
    monkeypatch.setenv("GRPO_SANDBOX_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(sb, "_base_dir", None)
    assert sb._uid_lock_dir() == first  # a different sandbox dir does not move the locks
    import fcntl

    (first / "uid-65000.lock").write_bytes(b"idle")  # a clean previous holder: nothing of uid 65000 is ours to kill
    slot = sb._UidSlot([65000])
    try:
        fd = os.open(first / "uid-65000.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another trainer cannot take uid 65000
        os.close(fd)
    finally:
        slot.release()


_ZOMBIE_SCRIPT = r'''
import ctypes, json, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: adopts orphans, never reaps them
child = subprocess.Popen([sys.executable, "-c", """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sb = sys.modules["sandbox_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)  # the sandbox module alone (stdlib only): no torch/TRL import
run_in_sandbox = sb.run_in_sandbox
for code, t in (("print(1)", 5), ("while True: pass", 1),
                ("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(30)\\n", 3)):
    run_in_sandbox(code, timeout=t)
""", sys.argv[1]])
child.wait()
time.sleep(0.5)
kids = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            st = open("/proc/%s/stat" % pid).read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        if int(f[1]) == os.getpid():
            kids.append(st[:40])
print(json.dumps(kids))
'''


@pytest.mark.skipif(not sandbox_capabilities()["pidns"] and not sandbox_capabilities()["uid_drop"],
                    reason="'process' mode without root: a setsid daemon escapes cleanup (documented)")
def test_no_zombie_under_a_parent_that_adopts_and_never_reaps():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    module = REPO / "grpo_variants" / "rewards" / "sandbox.py"
    out = subprocess.run([sys.executable, "-c", _ZOMBIE_SCRIPT, str(module)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------
# The trainer survives a run in which every completion is hostile
# ---------------------------------------------------------------------------------------------
TRAINING_HOSTILES = {
    "crash": "import os\nos.abort()\n",
    "stall": "while True:\n    pass\n",
    "forge": HOSTILE.split("# spinners")[0] + "def add(a, b):\n    return -1\n",
    "flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "hash flood": "def add(a, b):\n    return {k * ((1 << 61) - 1) for k in range(39000)}\n",
    "deep": "def add(a, b):\n    x = []\n    for _ in range(10 ** 5):\n        x = [x]\n    return x\n",
}


class _EveryCompletionHostile:
    """The code reward, fed a hostile program for every completion the trainer sampled (what the
    completions say does not matter: the reward sees only hostile programs)."""

    __name__ = "code_pass"

    def __init__(self, reward):
        self.reward, self.calls = reward, 0

    def __call__(self, prompts, completions, **kwargs):
        programs = list(TRAINING_HOSTILES.values())
        fake = [f"```python\n{programs[(self.calls + i) % len(programs)]}```" for i in range(len(completions))]
        self.calls += 1
        return self.reward(prompts=prompts, completions=fake, tests=[["assert add(1, 2) == 3"]] * len(fake))


@pytest.mark.slow
def test_training_where_every_completion_is_hostile_finishes(toy_model_path, small_train_dataset, make_args):
    from grpo_variants import GRPOVariantTrainer

    reward = _EveryCompletionHostile(make_code_reward("all"))  # default limits: budget 4 x a program-free run
    args = make_args(max_steps=2, reward_on_error="raise")  # any exception from the reward would stop training
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=[reward], args=args,
                                 train_dataset=small_train_dataset)
    trainer.train()
    assert trainer.state.global_step == 2 and reward.calls >= 2
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert logged and all(r["rewards/code_pass/mean"] == 0.0 for r in logged if "rewards/code_pass/mean" in r)
    reasons = [x for rs in reward.reward.last_reasons for x in rs]
    assert len(reward.reward.last_reasons) == 16 and all(reward.reward.last_reasons)  # each has its reason
    assert any("sent no result" in x or "raised" in x for x in reasons)
    # Every completion's budget is the relative one, far below the 10 s timeout a stall used to cost.
    budgets = reward.reward.last_budgets
    assert len(budgets) == 16 and all(0.5 <= b < 10.0 for b in budgets), budgets
    assert any("time_factor" in x for x in reasons)


def test_no_program_free_run_means_the_whole_timeout_said_in_one_line(caplog, monkeypatch):
    reward = make_code_reward("all", time_factor=4.0, min_timeout=0.5, timeout=3.0)
    from grpo_variants.rewards import judge

    monkeypatch.setattr(judge.ReferencePool, "startup", property(lambda self: None))  # no program-free run finished
    with caplog.at_level("WARNING"):
        assert reward(prompts=["p"], completions=[CORRECT_ADD], tests=[["assert add(1, 2) == 3"]]) == [1.0]
    assert reward.last_budgets == [3.0] and "no program-free run finished" in caplog.text
