"""The judge of the code rewards: it holds the expected results, the sandboxed program never does.

A program under test runs in its own process and interpreter (:mod:`grpo_variants.rewards.sandbox`).
What comes back from it is *data*: the value of each probe expression, serialised in the sandbox to a
restricted JSON format (below) and deserialised here by :func:`decode_value` into plain Python values
(never pickle, never ``eval``). The expected results stay on this side and the comparison happens
here, so nothing the program can patch — builtins, ``__main__``, ``sys.stdout``, frames, the harness
itself — takes part in deciding the score: the most a hostile program can do is report values of its
choice, which is what returning them would do, and it never sees the values it would have to report.

Supported test formats (the dataset's ``tests`` column; one sample's tests are a list of items or one
string of test code):

* **Assert statements** (strings), each ``assert`` one test; other top-level statements (imports,
  assignments, helper functions) are *setup* that runs, in order, in the program's namespace:

  - ``assert P == E`` (also ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``, either side):
    ``P`` is evaluated after the program, in the sandbox; ``E`` is the expected side. ``E`` is a
    literal (numbers, strings, bytes, tuples, lists, dicts, sets, ``True``/``False``/``None``, read
    with :func:`ast.literal_eval`), or any other expression that does not need the program (``[1] * 3``,
    ``set((1, 2))``, ``float('inf')``, a helper from the setup): it is then evaluated in a separate,
    program-free *reference run* in the sandbox (cached per distinct test).
  - ``assert P is None`` / ``is True`` / ``is False`` (and ``is not``).
  - ``assert math.isclose(P, E, rel_tol=..., abs_tol=...)`` (or ``isclose(...)``) and
    ``assert abs(P - E) < tol`` (``<=``), with a literal tolerance.
  - ``assert f(args)`` / ``assert not f(args)`` with literal arguments: the truthiness of the returned
    value (the parent computes it).
  - ``assert A and B``: every part must hold. A trailing message (``assert x == 1, "msg"``) is ignored.
  - HumanEval style: ``def check(candidate): assert candidate(1) == 2 ...`` followed by ``check(f)`` is
    unrolled into its asserts on ``f``.
  - Anything else (``assert all(f(i) == i for i in ...)``, ``assert isinstance(...)``): not judgeable
    without trusting the program's interpreter; ``on_unsupported="error"`` raises a
    :class:`~grpo_variants.errors.DatasetError` naming the test, ``"fail"`` counts it failed (warned once).
    So is an assert nested in a loop, an ``if`` or a helper function.
* **stdin/stdout cases**: a dict ``{"input": str, "output": str}`` as an item, or the whole column
  value ``{"inputs": [...], "outputs": [...]}`` (APPS/CodeContests style). The program runs once per
  case with that stdin; it passes when it exits with status 0 and its stdout equals the expected
  output up to trailing whitespace on each line and trailing blank lines.

Value format (the only thing read back from a run): JSON where ``null``, booleans, numbers (floats
keep a ``.0``; ``NaN``/``Infinity`` allowed), strings and arrays (lists) are themselves, and every
object is a tag: ``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset,
``{"d": [[k, v], ...]}`` dict, ``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex. Only these
types are encoded (an ``int``/``str``/``list``... subclass as its base value, a numpy value through
``tolist()``); anything else (an object with its own ``__eq__``) fails its test. Depth is capped at
64 and a run's records at ``max_output_bytes``.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from grpo_variants.errors import DatasetError

logger = logging.getLogger(__name__)

__all__ = ["parse_tests", "build_probe_program", "parse_records", "decode_value", "check_passes",
           "TestUnit", "Check", "StdioCase", "UnsupportedTest", "stdout_matches"]

MAX_DEPTH = 64
_COMPARE_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
                ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
# ``lit OP probe`` turned into ``probe OP' lit``.
_FLIP = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


class UnsupportedTest(ValueError):
    """A test whose verdict would have to be computed inside the program's interpreter."""


@dataclass
class Check:
    """One condition: the value of ``probe`` (evaluated with the program) against an expected value.

    ``expected`` is the literal value, or, when ``ref`` is set, the value of the expression ``ref``
    from the program-free reference run. ``reverse`` marks ``expected OP probe`` for ``in``/``not in``.
    ``alt`` (both sides non-literal) is the other side: whichever of the two the reference run can
    evaluate is the expected one.
    """

    probe: str
    op: str
    expected: Any = None
    ref: str | None = None
    reverse: bool = False
    alt: str | None = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0


@dataclass
class TestUnit:
    """One test (one ``assert``): its setup statements (run before it) and its checks (all must hold)."""

    source: str
    setup: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    unsupported: str | None = None


@dataclass
class StdioCase:
    input: str
    output: str


# --------------------------------------------------------------------------------------------
# Parsing the dataset's tests (this side only)
# --------------------------------------------------------------------------------------------
def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _is_isclose(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "isclose") or (
        isinstance(func, ast.Attribute) and func.attr == "isclose"
        and isinstance(func.value, ast.Name) and func.value.id in ("math", "cmath", "np", "numpy"))


def _checks_of(expr: ast.AST) -> list[Check]:
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And):
        return [c for v in expr.values for c in _checks_of(v)]
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        op = _COMPARE_OPS.get(type(expr.ops[0]))
        left, right = expr.left, expr.comparators[0]
        if op in ("is", "is not"):
            for probe, other in ((left, right), (right, left)):
                if isinstance(other, ast.Constant) and other.value in (None, True, False) and (
                        type(other.value) is bool or other.value is None):
                    return [Check(_src(probe), op, other.value)]
            raise UnsupportedTest("'is' compares only with None, True or False")
        # abs(P - E) < tol
        if op in ("<", "<=") and isinstance(left, ast.Call) and isinstance(left.func, ast.Name) \
                and left.func.id == "abs" and len(left.args) == 1 and isinstance(left.args[0], ast.BinOp) \
                and isinstance(left.args[0].op, ast.Sub):
            ok_tol, tol = _literal(right)
            if ok_tol and isinstance(tol, (int, float)):
                a, b = left.args[0].left, left.args[0].right
                for probe, exp in ((a, b), (b, a)):
                    ok, val = _literal(exp)
                    if ok and isinstance(val, (int, float)) and not isinstance(val, bool):
                        return [Check(_src(probe), "abs<" if op == "<" else "abs<=", val, abs_tol=float(tol))]
        if op is None:
            raise UnsupportedTest("unknown comparison")
        lok, lval = _literal(left)
        rok, rval = _literal(right)
        if rok and not lok:
            return [Check(_src(left), op, rval)]
        if lok and not rok:
            if op in ("in", "not in"):
                return [Check(_src(right), op, lval, reverse=True)]
            return [Check(_src(right), _FLIP[op], lval)]
        if lok and rok:
            return [Check("None", "const", _const_compare(lval, op, rval))]
        # Neither side is a literal: the reference run decides which side is the expected one.
        return [Check(_src(left), op, ref=_src(right), alt=_src(left))]
    if isinstance(expr, ast.Call) and _is_isclose(expr.func) and len(expr.args) == 2:
        kw = {}
        for k in expr.keywords:
            ok, v = _literal(k.value)
            if not ok or k.arg not in ("rel_tol", "abs_tol", "rtol", "atol"):
                raise UnsupportedTest("isclose with a non-literal or unknown keyword")
            kw["rel_tol" if k.arg in ("rel_tol", "rtol") else "abs_tol"] = float(v)
        a, b = expr.args
        for probe, exp in ((a, b), (b, a)):
            ok, val = _literal(exp)
            if ok:
                return [Check(_src(probe), "isclose", val, **kw)]
        return [Check(_src(a), "isclose", ref=_src(b), **kw)]
    ok, val = _literal(expr)
    if ok:  # ``assert True``: holds whenever the program ran
        return [Check("None", "const", bool(val))]
    negate = False
    inner = expr
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        negate, inner = True, expr.operand
    if isinstance(inner, ast.Call) and isinstance(inner.func, (ast.Name, ast.Attribute)) \
            and all(_literal(a)[0] for a in inner.args) and all(_literal(k.value)[0] for k in inner.keywords) \
            and not any(isinstance(a, ast.Starred) for a in inner.args):
        return [Check(_src(inner), "falsy" if negate else "truthy")]
    raise UnsupportedTest("the verdict would be computed by the program's interpreter")


def _const_compare(a, op, b) -> bool:
    try:
        return _apply(a, op, b)
    except Exception:
        return False


def _split_items(tests: Any) -> list[Any]:
    if tests is None:
        return []
    if isinstance(tests, dict):
        if "inputs" in tests and "outputs" in tests:
            ins, outs = list(tests["inputs"]), list(tests["outputs"])
            if len(ins) != len(outs):
                raise DatasetError(f"stdin/stdout tests: {len(ins)} inputs but {len(outs)} outputs.")
            return [StdioCase(_as_text(i), _as_text(o)) for i, o in zip(ins, outs)]
        return [tests]
    if isinstance(tests, (list, tuple)):
        return [t for t in tests if t is not None and (not isinstance(t, str) or t.strip())]
    return [str(tests)] if str(tests).strip() else []


def _as_text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "\n".join(str(x) for x in v)
    return "" if v is None else str(v)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old else node


def _statements(tree: ast.Module, lines: list[str]):
    """Top-level statements with their source; a HumanEval-style ``def check(candidate): ...`` followed
    by ``check(f)`` is unrolled into its body with ``candidate`` renamed to ``f``."""
    body = tree.body
    checks = {n.name: n for n in body if isinstance(n, ast.FunctionDef) and n.args.args and len(n.args.args) == 1}
    calls = [n for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
             and isinstance(n.value.func, ast.Name) and n.value.func.id in checks
             and len(n.value.args) == 1 and isinstance(n.value.args[0], ast.Name)]
    unrolled = {c.value.func.id for c in calls}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in unrolled:
            continue  # expanded where it is called
        if node in calls:
            fn = checks[node.value.func.id]
            rename = _Rename(fn.args.args[0].arg, node.value.args[0].id)
            for stmt in fn.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # docstring
                stmt = ast.fix_missing_locations(rename.visit(stmt))
                yield stmt, ast.unparse(stmt) + "\n"
            continue
        yield node, "".join(lines[node.lineno - 1: node.end_lineno])


def parse_tests(tests: Any) -> tuple[list[TestUnit], list[StdioCase]]:
    """Split a sample's tests into assert-style units (with their setup) and stdin/stdout cases.

    A unit the judge cannot decide outside the program has ``unsupported`` set (the reason)."""
    units: list[TestUnit] = []
    cases: list[StdioCase] = []
    pending: list[str] = []
    for item in _split_items(tests):
        if isinstance(item, StdioCase):
            cases.append(item)
            continue
        if isinstance(item, dict):
            if "input" in item and "output" in item:
                cases.append(StdioCase(_as_text(item["input"]), _as_text(item["output"])))
                continue
            raise DatasetError(f"A test dict needs 'input' and 'output' keys, got {sorted(item)}.")
        text = str(item)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            units.append(TestUnit(text, list(pending), unsupported=f"does not parse: {exc}"))
            pending = []
            continue
        lines = text.splitlines(keepends=True)
        for node, seg in _statements(tree, lines):
            if isinstance(node, ast.Assert):
                unit = TestUnit(seg.strip(), list(pending))
                pending = []
                try:
                    unit.checks = _checks_of(node.test)
                except UnsupportedTest as exc:
                    unit.unsupported = str(exc)
                units.append(unit)
            elif any(isinstance(n, ast.Assert) for n in ast.walk(node)):
                # An assert inside a loop/if/function body: its verdict would come from the sandbox.
                units.append(TestUnit(seg.strip(), list(pending), unsupported="an assert nested in a statement"))
                pending = []
            else:
                pending.append(seg)
    return units, cases  # trailing setup with no assert after it has nothing to judge


# --------------------------------------------------------------------------------------------
# The probe program (runs in the sandbox; only values leave it)
# --------------------------------------------------------------------------------------------
_HARNESS = r'''
import os as _os, sys as _sys, json as _json, signal as _signal
_PROGRAM = {program!r}
_STEPS = {steps!r}
_TAG = {tag!r}
_TIMEOUT = {timeout!r}
_OUT = _os.dup(1)
_null = _os.open(_os.devnull, _os.O_RDWR)
_os.dup2(_null, 1)
_os.dup2(_null, 0)
def _emit(rec):
    try:
        line = (_TAG + " " + _json.dumps(rec) + "\n").encode()
    except Exception as e:
        bad = {{"i": rec.get("i"), "e": "unencodable: " + type(e).__name__}}
        line = (_TAG + " " + _json.dumps(bad) + "\n").encode()
    while line:
        line = line[_os.write(_OUT, line):]
def _enc(v, d=0):
    if d > {depth}:
        raise ValueError("nested too deep")
    if v is None or v is True or v is False:
        return v
    t = type(v)
    if t is int or t is float or t is str:
        return v
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, list):
        return [_enc(x, d + 1) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {{"t": [_enc(x, d + 1) for x in tuple.__iter__(v)]}}
    if isinstance(v, dict):
        return {{"d": [[_enc(k, d + 1), _enc(x, d + 1)] for k, x in dict.items(v)]}}
    if isinstance(v, frozenset):
        return {{"fs": [_enc(x, d + 1) for x in frozenset.__iter__(v)]}}
    if isinstance(v, set):
        return {{"s": [_enc(x, d + 1) for x in set.__iter__(v)]}}
    if isinstance(v, (bytes, bytearray)):
        return {{"b": bytes(v).hex()}}
    if isinstance(v, complex):
        return {{"c": [complex(v).real, complex(v).imag]}}
    if hasattr(v, "tolist") and type(v).__module__.startswith("numpy"):
        return _enc(v.tolist(), d + 1)
    raise TypeError("cannot encode a " + type(v).__name__)
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
def _timed(fn):
    _signal.signal(_signal.SIGALRM, _alarm)
    _signal.setitimer(_signal.ITIMER_REAL, _TIMEOUT)
    try:
        return fn()
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
_ns = {{"__name__": "__solution__", "__builtins__": __builtins__}}
try:
    exec(compile(_PROGRAM, "<program>", "exec"), _ns)
    _emit({{"program": "ok"}})
except SystemExit as e:
    _emit({{"program": "ok" if e.code in (None, 0) else "exit"}})
except BaseException as e:
    _emit({{"program": "error", "e": type(e).__name__}})
    _os._exit(0)
for _step in _STEPS:
    if _step[0] == "x":
        try:
            _timed(lambda: exec(compile(_step[1], "<setup>", "exec"), _ns))
        except BaseException:
            pass
        continue
    try:
        _v = _timed(lambda: eval(compile(_step[2], "<probe>", "eval"), _ns))
        _emit({{"i": _step[1], "v": _enc(_v)}})
    except BaseException as e:
        _emit({{"i": _step[1], "e": type(e).__name__}})
_os._exit(0)
'''


def build_probe_program(program: str, steps: Sequence[tuple], *, tag: str, test_timeout: float) -> str:
    """The sandbox script: runs ``program`` (may be empty: a reference run), then ``steps`` in its
    namespace: ``("x", src)`` setup statements, ``("p", index, expr)`` probes whose values it prints
    as ``tag JSON`` lines on the original stdout (the program's own stdout goes to /dev/null)."""
    return _HARNESS.format(program=program, steps=[list(s) for s in steps], tag=tag,
                           timeout=float(test_timeout), depth=MAX_DEPTH)


def new_tag() -> str:
    return "grpo-judge-" + secrets.token_hex(8)


# --------------------------------------------------------------------------------------------
# Reading the values back (this side)
# --------------------------------------------------------------------------------------------
class _Bad(ValueError):
    pass


def decode_value(obj: Any, depth: int = 0) -> Any:
    """Rebuild a Python value from the restricted JSON format; raises ValueError on anything else."""
    if depth > MAX_DEPTH + 2:
        raise _Bad("nested too deep")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode_value(x, depth + 1) for x in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        (tag, payload), = obj.items()
        if tag == "b" and isinstance(payload, str):
            return bytes.fromhex(payload)
        if not isinstance(payload, list):
            raise _Bad("bad payload")
        if tag == "t":
            return tuple(decode_value(x, depth + 1) for x in payload)
        if tag == "s":
            return set(decode_value(x, depth + 1) for x in payload)
        if tag == "fs":
            return frozenset(decode_value(x, depth + 1) for x in payload)
        if tag == "c" and len(payload) == 2 and all(isinstance(x, (int, float)) for x in payload):
            return complex(payload[0], payload[1])
        if tag == "d":
            out = {}
            for kv in payload:
                if not isinstance(kv, list) or len(kv) != 2:
                    raise _Bad("bad dict item")
                out[decode_value(kv[0], depth + 1)] = decode_value(kv[1], depth + 1)
            return out
    raise _Bad("unknown value")


@dataclass
class Records:
    program: str | None = None  # "ok", "exit", "error" or None (never got there)
    values: dict = field(default_factory=dict)  # probe index -> ("v", value) or ("e", error name)


def parse_records(stdout: str, tag: str, n_probes: int) -> Records:
    """The first record per probe index from a run's stdout (lines ``tag JSON``); malformed lines are ignored."""
    rec = Records()
    prefix = tag + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            obj = json.loads(line[len(prefix):])
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict):
            continue
        if "program" in obj:
            if rec.program is None and obj["program"] in ("ok", "exit", "error"):
                rec.program = obj["program"]
            continue
        i = obj.get("i")
        if type(i) is not int or not 0 <= i < n_probes or i in rec.values:
            continue
        if "v" in obj:
            try:
                rec.values[i] = ("v", decode_value(obj["v"]))
            except (ValueError, TypeError, RecursionError):
                rec.values[i] = ("e", "undecodable")
        else:
            rec.values[i] = ("e", str(obj.get("e"))[:100])
    return rec


def _apply(v: Any, op: str, exp: Any, reverse: bool = False, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    if op == "==":
        return bool(v == exp)
    if op == "!=":
        return bool(v != exp)
    if op == "<":
        return bool(v < exp)
    if op == "<=":
        return bool(v <= exp)
    if op == ">":
        return bool(v > exp)
    if op == ">=":
        return bool(v >= exp)
    if op in ("in", "not in"):
        inside = (exp in v) if reverse else (v in exp)
        return inside if op == "in" else not inside
    if op == "is":
        return v is exp
    if op == "is not":
        return v is not exp
    if op == "truthy":
        return bool(v)
    if op == "falsy":
        return not v
    if op == "isclose":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(exp, bool) \
                or not isinstance(exp, (int, float)):
            return False
        return math.isclose(v, exp, rel_tol=rel_tol, abs_tol=abs_tol)
    if op in ("abs<", "abs<="):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        d = abs(v - exp)
        return d < abs_tol if op == "abs<" else d <= abs_tol
    raise ValueError(op)


def check_passes(check: Check, got: tuple | None, expected: Any) -> bool:
    """Does the decoded probe value ``got`` (("v", value) / ("e", err) / None) meet ``check``?"""
    if check.op == "const":
        return bool(check.expected)
    if got is None or got[0] != "v":
        return False
    try:
        return _apply(got[1], check.op, expected, check.reverse, check.rel_tol, check.abs_tol)
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError):
        return False


def stdout_matches(out: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(out) == norm(expected)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args) -> None:
    with _warned_lock:
        if key in _warned or len(_warned) > 200:
            return
        _warned.add(key)
    logger.warning(message, *args)
