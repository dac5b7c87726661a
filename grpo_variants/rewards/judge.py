"""The judge of the code rewards: it holds the expected results, the sandboxed program never does.

**Invariant (by construction).** Nothing that is, or leads to, an expected value is evaluated in, sent
to, or reachable from the program's process. Each sample's tests are split (:func:`plan_tests`) into
two sandbox runs:

* the **program run** executes the program, then only what the *program side* of each assert needs:
  the setup statements that give the program its inputs (``x = [3, 1, 2]``, a helper class passed to
  it), the setup statements that call the program (``sort_in_place(lst)``), and the program-side
  expressions (``f(x)``), whose *values* it reports;
* the **reference run** (program-free, cached per distinct test) executes the setup the *expected
  sides* need and evaluates them (``sorted(orig)``, ``_ref(x)``, a constant ``expected = 3``).

The verdict (``==``, ``in``, ``isclose`` ...) is computed in the trainer's process on decoded data.
Which side needs the program is decided statically from names: a name the tests do not bind (nor
builtins) is the program's; a setup statement that mentions a program name is run with the program,
and every name it mentions (it may mutate them, through aliases too) is then program-side. Refused
(marked *unsupported*, never judged silently): a setup statement the program needs that also binds a
name only an expected side uses (``inp, exp = (1, 2), 3``); a program side that uses test data other
than as the program's arguments (``abs(f(x) - exp) < tol`` is recognised and split, ``f(x) - exp == 0``
is refused); a truthiness assert whose verdict the program's interpreter would compute
(``assert all(f(i) == i for i in ...)``); an assert nested in a loop, ``if`` or function; ``is`` other
than with ``None``/``True``/``False``. When *both* sides need the program (``assert add(1, 2) ==
add(2, 1)``) both are program-side values compared here: no expected value exists, as in Python.

What the program can still do in its own process (patch builtins, rewrite the harness, write records
on the result stream itself) amounts to choosing the values it reports, which returning them does too;
it never holds the values that would score. Records are read by :func:`parse_records`, which cannot
fail or stall: sizes, depth and element counts are bounded before anything is built, sets and dict keys
are compared through a keyed (trainer-secret) hash of a canonical form (no quadratic collisions), and
every exception means "this probe failed".

Supported test formats (the dataset's ``tests`` column; one sample's tests are a list of items or one
string of test code):

* **Assert statements** (strings), each ``assert`` one test; other top-level statements (imports,
  assignments, helper functions, calls) are setup, split as above:

  - ``assert A == B`` (also ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``, chained
    comparisons): each side is a literal (read here with :func:`ast.literal_eval`), a program-side
    expression or a reference-side expression.
  - ``assert P is None`` / ``is True`` / ``is False`` (and ``is not``).
  - ``assert math.isclose(A, B, rel_tol=..., abs_tol=...)`` (or ``isclose(...)``) and
    ``assert abs(A - B) < tol`` (``<=``), with a literal tolerance.
  - ``assert f(...)`` / ``assert not f(...)`` where ``f`` is the program's (a call, attribute or value
    rooted at a program name): the truthiness of the returned value (computed here).
  - ``assert A and B``: every part must hold. A trailing message (``assert x == 1, "msg"``) is ignored.
  - HumanEval style: ``def check(candidate): assert candidate(1) == 2 ...`` followed by ``check(f)`` is
    unrolled into its asserts on ``f``.
* **stdin/stdout cases**: a dict ``{"input": str, "output": str}`` as an item, or the whole column
  value ``{"inputs": [...], "outputs": [...]}`` (APPS/CodeContests style). The program runs once per
  case with that stdin; it passes when it exits with status 0 and its stdout equals the expected
  output up to trailing whitespace on each line and trailing blank lines.

Value format (the only thing read back from a run): JSON where ``null``, booleans, numbers (floats
keep a ``.0``; ``NaN``/``Infinity`` allowed), strings and arrays (lists) are themselves, and every
object is a tag: ``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset,
``{"d": [[k, v], ...]}`` dict, ``{"od": [[k, v], ...]}`` OrderedDict (order compared, as Python does),
``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex. Only these types are encoded (an ``int``/``str``/
``list``... subclass as its base value, a numpy value through ``tolist()``); anything else (an object
with its own ``__eq__``) fails its test. Depth is capped at 64, elements at 200,000 per value, and a
run's records at ``max_output_bytes``.
"""

from __future__ import annotations

import ast
import builtins
import collections
import hashlib
import json
import logging
import math
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from grpo_variants.errors import DatasetError

logger = logging.getLogger(__name__)

__all__ = ["parse_tests", "plan_tests", "build_probe_program", "parse_records", "decode_value", "encode_value",
           "normalize", "check_passes", "unit_verdict", "TestUnit", "Check", "Side", "Plan", "StdioCase",
           "UnsupportedTest", "stdout_matches", "Records"]

MAX_DEPTH = 64
MAX_ELEMENTS = 200_000
_COMPARE_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
                ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_BUILTINS = frozenset(dir(builtins))
# Calls that do not mutate their arguments: a setup statement ``y = sorted(x)`` does not change ``x``.
_PURE = frozenset({"sorted", "len", "list", "tuple", "set", "frozenset", "dict", "str", "int", "float", "bool",
                   "bytes", "sum", "min", "max", "abs", "range", "enumerate", "zip", "map", "filter", "reversed",
                   "any", "all", "repr", "round", "divmod", "pow", "ord", "chr", "hash", "isinstance", "type",
                   "id", "print", "complex", "hex", "oct", "bin", "format", "ascii", "iter", "deepcopy", "copy"})


class UnsupportedTest(ValueError):
    """A test whose verdict would have to be computed inside the program's interpreter, or whose expected
    value the program would see."""


@dataclass
class Side:
    """One side of a check: a literal (``expr`` None, ``value`` set), or an expression evaluated in the
    program run (``run="program"``) or the reference run (``run="reference"``) as probe ``index``."""

    expr: str | None
    value: Any = None
    run: str = "literal"
    index: int = -1
    node: Any = field(default=None, repr=False, compare=False)


@dataclass
class Check:
    """One condition ``left op right`` (``right`` None for ``truthy``/``falsy``)."""

    op: str
    left: Side
    right: Side | None = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0


@dataclass
class TestUnit:
    """One test (one ``assert``): its checks (all must hold), or why it cannot be judged."""

    source: str
    checks: list[Check] = field(default_factory=list)
    unsupported: str | None = None
    setup: list[str] = field(default_factory=list)  # the setup statements before it (for messages)


@dataclass
class StdioCase:
    input: str
    output: str


@dataclass
class Plan:
    """A sample's tests split into the program run's steps and the reference run's steps.

    Steps: ``("x", source)`` a setup statement, ``("p", index, expression)`` a probe."""

    units: list[TestUnit]
    cases: list[StdioCase]
    program_steps: list = field(default_factory=list)
    reference_steps: list = field(default_factory=list)
    n_program: int = 0
    n_reference: int = 0

    @property
    def ref_key(self) -> str | None:
        return json.dumps(self.reference_steps) if self.n_reference else None

    @property
    def supported_units(self) -> list[TestUnit]:
        return [u for u in self.units if u.unsupported is None]


# --------------------------------------------------------------------------------------------
# Parsing the dataset's tests (this side only)
# --------------------------------------------------------------------------------------------
def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _side(node: ast.AST) -> Side:
    ok, val = _literal(node)
    if ok:
        return Side(None, normalize(val), "literal")
    return Side(ast.unparse(node), node=node)


def _is_isclose(func: ast.AST) -> bool:
    return (isinstance(func, ast.Name) and func.id == "isclose") or (
        isinstance(func, ast.Attribute) and func.attr == "isclose"
        and isinstance(func.value, ast.Name) and func.value.id in ("math", "cmath", "np", "numpy"))


def _checks_of(expr: ast.AST) -> list[Check]:
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.And):
        return [c for v in expr.values for c in _checks_of(v)]
    if isinstance(expr, ast.Compare):
        ops = [_COMPARE_OPS.get(type(o)) for o in expr.ops]
        if None in ops:
            raise UnsupportedTest("unknown comparison")
        nodes = [expr.left, *expr.comparators]
        if len(ops) > 1:  # a < b < c: a < b and b < c
            if any(o in ("is", "is not") for o in ops):
                raise UnsupportedTest("chained 'is'")
            return [Check(op, _side(nodes[k]), _side(nodes[k + 1])) for k, op in enumerate(ops)]
        op, left, right = ops[0], nodes[0], nodes[1]
        if op in ("is", "is not"):
            for probe, other in ((left, right), (right, left)):
                if isinstance(other, ast.Constant) and (other.value is None or type(other.value) is bool):
                    return [Check(op, _side(probe), Side(None, other.value))]
            raise UnsupportedTest("'is' compares only with None, True or False")
        # abs(A - B) < tol
        if op in ("<", "<=") and isinstance(left, ast.Call) and isinstance(left.func, ast.Name) \
                and left.func.id == "abs" and len(left.args) == 1 and not left.keywords \
                and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub):
            ok_tol, tol = _literal(right)
            if ok_tol and isinstance(tol, (int, float)) and not isinstance(tol, bool):
                a, b = left.args[0].left, left.args[0].right
                return [Check("abs<" if op == "<" else "abs<=", _side(a), _side(b), abs_tol=float(tol))]
        return [Check(op, _side(left), _side(right))]
    if isinstance(expr, ast.Call) and _is_isclose(expr.func) and len(expr.args) == 2:
        kw = {}
        for k in expr.keywords:
            ok, v = _literal(k.value)
            if not ok or k.arg not in ("rel_tol", "abs_tol", "rtol", "atol") or isinstance(v, bool) \
                    or not isinstance(v, (int, float)):
                raise UnsupportedTest("isclose with a non-literal or unknown keyword")
            kw["rel_tol" if k.arg in ("rel_tol", "rtol") else "abs_tol"] = float(v)
        return [Check("isclose", _side(expr.args[0]), _side(expr.args[1]), **kw)]
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return [Check("falsy", _side(expr.operand))]
    return [Check("truthy", _side(expr))]


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


def _statements(tree: ast.Module):
    """Top-level statements; a HumanEval-style ``def check(candidate): ...`` followed by ``check(f)`` is
    unrolled into its body with ``candidate`` renamed to ``f``."""
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
                yield ast.fix_missing_locations(rename.visit(stmt))
            continue
        yield node


# ---- names: what an expression or statement reads and binds (scope-aware, conservative) ----
def _names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(free names read, names bound) of ``node``; names bound inside a lambda, comprehension, function
    or class body are local to it."""
    loads: set[str] = set()
    stores: set[str] = set()

    def visit(n: ast.AST, lo: set, st: set) -> None:
        if isinstance(n, ast.Name):
            (lo if isinstance(n.ctx, ast.Load) else st).add(n.id)
            return
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if not isinstance(n, ast.Lambda):
                st.add(n.name)
                for d in n.decorator_list:
                    visit(d, lo, st)
            a = n.args
            for d in [*a.defaults, *[x for x in a.kw_defaults if x is not None]]:
                visit(d, lo, st)
            params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
            il, ist = set(), set()
            for b in (n.body if isinstance(n.body, list) else [n.body]):
                visit(b, il, ist)
            lo |= il - ist - params
            return
        if isinstance(n, ast.ClassDef):
            st.add(n.name)
            for d in [*n.decorator_list, *n.bases, *[k.value for k in n.keywords]]:
                visit(d, lo, st)
            il, ist = set(), set()
            for b in n.body:
                visit(b, il, ist)
            lo |= il - ist
            return
        if isinstance(n, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            il, ist = set(), set()
            for g in n.generators:
                visit(g, il, ist)
            for e in ([n.key, n.value] if isinstance(n, ast.DictComp) else [n.elt]):
                visit(e, il, ist)
            lo |= il - ist
            return
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                st.add((a.asname or a.name).split(".")[0])
            return
        for c in ast.iter_child_nodes(n):
            visit(c, lo, st)

    visit(node, loads, stores)
    return loads, stores


def _root_name(n: ast.AST) -> str | None:
    while isinstance(n, (ast.Attribute, ast.Subscript, ast.Call)):
        n = n.func if isinstance(n, ast.Call) else n.value
    return n.id if isinstance(n, ast.Name) else None


def _touched(node: ast.AST) -> set[str]:
    """Names a statement may mutate in place: method-call receivers, subscript/attribute assignment
    targets, augmented assignments, arguments of calls that are not known to be pure."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Attribute):
                r = _root_name(n.func.value)
                if r:
                    out.add(r)
            fname = n.func.id if isinstance(n.func, ast.Name) else (
                n.func.attr if isinstance(n.func, ast.Attribute) else None)
            if fname not in _PURE:
                for a in [*n.args, *[k.value for k in n.keywords]]:
                    r = _root_name(a.value if isinstance(a, ast.Starred) else a)
                    if r:
                        out.add(r)
        elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, (ast.Store, ast.Del)):
            r = _root_name(n)
            if r:
                out.add(r)
        elif isinstance(n, ast.AugAssign):
            r = _root_name(n.target)
            if r:
                out.add(r)
    return out


def _alias_names(expr: ast.AST) -> set[str]:
    """Names whose objects ``expr``'s value may contain or be (calls are taken to build new objects)."""
    out: set[str] = set()

    def visit(n: ast.AST) -> None:
        if isinstance(n, ast.Call):
            return
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        for c in ast.iter_child_nodes(n):
            visit(c)

    visit(expr)
    return out


@dataclass
class _Stmt:
    pos: int
    source: str
    loads: set
    stores: set
    touched: set
    clean_loads: set


class _Planner:
    """Walks a sample's statements and asserts in order, deciding what runs where (see the module doc)."""

    def __init__(self) -> None:
        self.clean: set[str] = set()      # bound by program-free setup
        self.imports: set[str] = set()    # modules and names imported by the setup
        self.tainted: set[str] = set()    # bound by code that ran with the program: program values
        self.soft: set[str] = set()       # test data handed to the program (it may have mutated it)
        self.alias: dict[str, str] = {}   # union-find over clean names linked by a statement
        self.pf: list[_Stmt] = []         # program-free setup statements
        self.program_items: list[tuple[int, tuple]] = []   # (pos, step) with step ("x", src) or ("p", side)
        self.reference_items: list[tuple[int, Side, set]] = []
        self.program_needs: list[tuple[str, int, Any]] = []  # (name, position, the side needing it or None)
        self.blocked: str | None = None   # a statement run with the program exposed test data

    def kind(self, name: str) -> str:
        if name in self.tainted:
            return "P"
        if name in self.clean or name in self.imports:
            return "C"
        if name in _BUILTINS:
            return "B"
        return "P"

    def _find(self, n: str) -> str:
        while self.alias.get(n, n) != n:
            n = self.alias[n]
        return n

    def _taint(self, names) -> None:
        for n in names:
            if n not in self.imports:
                self.tainted.add(n)
                self.clean.discard(n)
                self.soft.discard(n)

    def _soften(self, names) -> None:
        roots = {self._find(n) for n in names if n in self.clean}
        self.soft |= {n for n in self.clean if self._find(n) in roots}

    def _outside_inputs(self, node: ast.AST) -> set[str]:
        """Test-data names a program-side expression uses other than as the program's arguments,
        comprehension iterables or subscripts (imports and builtins excepted)."""
        out: set[str] = set()

        def visit(n: ast.AST) -> None:
            if isinstance(n, ast.Name):
                if isinstance(n.ctx, ast.Load) and n.id in self.clean and n.id not in self.imports \
                        and n.id not in self.soft:
                    out.add(n.id)
                return
            if isinstance(n, ast.Call):
                root = _root_name(n.func)
                if root is not None and self.kind(root) == "P":
                    visit(n.func)
                    return  # the arguments are the program's inputs
            if isinstance(n, ast.comprehension):
                visit(n.target)
                for c in n.ifs:
                    visit(c)
                return  # the iterable is an input
            if isinstance(n, ast.Subscript):
                visit(n.value)
                return
            for c in ast.iter_child_nodes(n):
                visit(c)

        visit(node)
        loads, _ = _names(node)
        return out & loads

    def statement(self, pos: int, node: ast.AST) -> None:
        src = ast.unparse(node)
        loads, stores = _names(node)
        # A name the statement binds itself (a loop variable) is not the program's.
        loads = {n for n in loads if not (n in stores and n not in self.tainted and self.kind(n) == "P")}
        if any(self.kind(n) == "P" for n in loads):
            clean_loads = {n for n in loads if self.kind(n) == "C"}
            outside = self._outside_inputs(node) - stores
            if outside or self.blocked:
                # It would show the program test data: it never runs, and no later test can be judged.
                self.blocked = self.blocked or (
                    f"the setup statement {src[:80]!r} runs with the program and uses the tests' "
                    f"{', '.join(sorted(outside))} other than as the program's arguments")
                self._taint(stores - self.imports)
                return
            self.program_needs += [(n, pos, None) for n in clean_loads]
            self._soften({n for n in loads | _touched(node) if n in self.clean})
            self._taint(stores - self.imports)
            self.program_items.append((pos, ("x", src)))
            return
        touched = _touched(node)
        clean_loads = {n for n in loads if n in self.clean}
        for n in stores:
            self.tainted.discard(n)
            self.soft.discard(n)
            self.alias[n] = n
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.add(n)
            else:
                self.clean.add(n)
        # Aliases: ``b = a`` / ``b = [a]`` (not ``b = f(a)``), ``a.append(b)``.
        groups: list[set[str]] = []
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            groups.append(stores | _alias_names(node.value))
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                r = _root_name(n.func.value)
                if r:
                    groups.append({r} | {a.id for a in n.args if isinstance(a, ast.Name)})
        for g in groups:
            g = [n for n in g if n in self.clean]
            for n in g[1:]:
                a, b = self._find(n), self._find(g[0])
                if a != b:
                    self.alias[a] = b
        self.pf.append(_Stmt(pos, src, loads, stores, touched, clean_loads))

    def unit(self, pos: int, unit: TestUnit) -> None:
        if unit.unsupported is not None:
            return
        if self.blocked:
            unit.unsupported = self.blocked
            return
        mentioned: set[str] = set()
        placed: list[tuple[Side, str]] = []
        try:
            for c in unit.checks:
                sides = [s for s in (c.left, c.right) if s is not None and s.node is not None]
                loads = {id(s): _names(s.node)[0] for s in sides}
                hard = {id(s): any(self.kind(n) == "P" for n in loads[id(s)]) for s in sides}
                for s in sides:
                    other_hard = any(hard[id(o)] for o in sides if o is not s)
                    # A side is the program's when it needs the program; a side reading only test data
                    # the program was handed (``lst`` after ``sort_in_place(lst)``) is the program's
                    # unless the other side needs the program (then it is the expected side).
                    on_program = hard[id(s)] or (not other_hard and bool(loads[id(s)] & self.soft))
                    if on_program:
                        outside = self._outside_inputs(s.node)
                        if outside:
                            raise UnsupportedTest(
                                f"the program side {s.expr[:80]!r} uses the tests' {', '.join(sorted(outside))} "
                                "other than as the program's arguments: the program would see it")
                        if c.op in ("truthy", "falsy"):
                            root = _root_name(s.node)
                            if root is None or (self.kind(root) != "P" and root not in self.soft):
                                raise UnsupportedTest("the verdict would be computed by the program's interpreter")
                        placed.append((s, "program"))
                        mentioned |= loads[id(s)]
                    else:
                        placed.append((s, "reference"))
        except UnsupportedTest as exc:
            unit.unsupported = str(exc)
            return
        for s, run in placed:
            s.run = run
            if run == "program":
                self.program_items.append((pos, ("p", s)))
                self.program_needs += [(n, pos, s) for n in _names(s.node)[0] if self.kind(n) == "C"]
            else:
                self.reference_items.append((pos, s, {n for n in _names(s.node)[0] if self.kind(n) == "C"}))
        # The program may have mutated what it was given.
        self._soften({n for n in mentioned if self.kind(n) == "C"})

    def closure(self, needs: list[tuple[str, int]]) -> tuple[set[int], set[str]]:
        """Positions of the program-free statements ``needs`` depend on, and the names involved."""
        included: set[int] = set()
        names: set[str] = set()
        work = list(needs)
        while work:
            n, p = work.pop()
            names.add(n)
            for s in self.pf:
                if s.pos < p and s.pos not in included and (n in s.stores or (n in s.touched and not s.stores)):
                    included.add(s.pos)
                    work += [(m, s.pos) for m in s.clean_loads | (s.touched - s.stores)]
        return included, names


def parse_tests(tests: Any) -> tuple[list[TestUnit], list[StdioCase]]:
    """Split a sample's tests into assert-style units and stdin/stdout cases (see :func:`plan_tests`)."""
    plan = plan_tests(tests)
    return plan.units, plan.cases


def plan_tests(tests: Any) -> Plan:
    """Parse a sample's tests and split them into the program run and the reference run.

    A unit the judge cannot decide without handing the program an expected value, or without trusting
    the program's interpreter, has ``unsupported`` set (the reason)."""
    units: list[TestUnit] = []
    cases: list[StdioCase] = []
    items: list[tuple[str, Any]] = []
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
            stmts = list(_statements(tree))
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            units.append(TestUnit(text, unsupported=f"does not parse: {exc}", setup=list(pending)))
            pending = []
            continue
        for node in stmts:
            try:
                seg = ast.unparse(node)
            except RecursionError:
                seg = "<too deep>"
            if isinstance(node, ast.Assert):
                unit = TestUnit(seg.strip(), setup=list(pending))
                pending = []
                try:
                    unit.checks = _checks_of(node.test)
                except UnsupportedTest as exc:
                    unit.unsupported = str(exc)
                except RecursionError:
                    unit.unsupported = "nested too deep"
                units.append(unit)
                items.append(("u", unit))
            elif any(isinstance(n, ast.Assert) for n in ast.walk(node)):
                units.append(TestUnit(seg.strip(), unsupported="an assert nested in a statement", setup=list(pending)))
                pending = []
            else:
                pending.append(seg + "\n")
                items.append(("s", node))
    plan = Plan(units, cases)
    planner = _Planner()
    try:
        for pos, (kind, obj) in enumerate(items):
            if kind == "s":
                planner.statement(pos, obj)
            else:
                planner.unit(pos, obj)
    except RecursionError:
        for u in units:
            u.unsupported = u.unsupported or "nested too deep"
        return plan
    prog_pos, prog_names = planner.closure([(n, p) for n, p, _ in planner.program_needs])
    # Units whose expected side would depend on a name that a statement run with the program also binds.
    leaked: set[str] = set()
    for s in planner.pf:
        if s.pos in prog_pos:
            leaked |= s.stores - prog_names
    ref_items = []
    for pos, side, clean_names in planner.reference_items:
        _, names = planner.closure([(n, pos) for n in clean_names])
        ref_items.append((pos, side, names, clean_names))
    bad_units = set()
    if leaked:
        for u in units:
            for c in u.checks:
                for s in (c.left, c.right):
                    for pos, side, names, _ in ref_items:
                        if side is s and names & leaked:
                            bad_units.add(id(u))
                            u.unsupported = u.unsupported or (
                                f"a setup statement run with the program binds {', '.join(sorted(names & leaked))}, "
                                "which the expected side uses: the program would see it (split the statement)")
    live_refs = [(pos, side, cl) for pos, side, _, cl in ref_items if not any(
        side is s for u in units if id(u) in bad_units or u.unsupported for c in u.checks for s in (c.left, c.right))]
    live_prog = [(pos, step) for pos, step in planner.program_items if step[0] == "x" or not any(
        step[1] is s for u in units if u.unsupported for c in u.checks for s in (c.left, c.right))]
    ref_pos, _ = planner.closure([(n, pos) for pos, side, cl in live_refs for n in cl])
    dead = {id(s) for u in units if u.unsupported for c in u.checks for s in (c.left, c.right) if s is not None}
    prog_pos, _ = planner.closure([(n, p) for n, p, side in planner.program_needs if id(side) not in dead])
    # Program run: needed program-free setup, setup run with the program, program-side probes, in order.
    steps: list[tuple[int, int, tuple]] = [(s.pos, 0, ("x", s.source)) for s in planner.pf if s.pos in prog_pos]
    steps += [(pos, 1, step) for pos, step in live_prog]
    plan.program_steps, plan.n_program = _numbered_steps(steps)
    rsteps: list[tuple[int, int, tuple]] = [(s.pos, 0, ("x", s.source)) for s in planner.pf if s.pos in ref_pos]
    rsteps += [(pos, 1, ("p", side)) for pos, side, _ in live_refs]
    plan.reference_steps, plan.n_reference = _numbered_steps(rsteps)
    return plan


def _numbered_steps(steps: list[tuple[int, int, tuple]]) -> tuple[list[tuple], int]:
    """Order one run's steps by source position (setup before probes at the same position) and number its
    probes 0..n-1 (each side records its index): ``(["x", source] | ["p", index, expr], ...)``, n."""
    out: list[tuple] = []
    n = 0
    for _pos, _, step in sorted(steps, key=lambda t: (t[0], t[1])):
        if step[0] == "x":
            out.append(("x", step[1]))
        else:
            step[1].index = n
            out.append(("p", n, step[1].expr))
            n += 1
    return out, n


# --------------------------------------------------------------------------------------------
# The value encoder (runs in the sandbox, and here for literals)
# --------------------------------------------------------------------------------------------
_ENC_SRC = r'''
def _enc(v, d=0, _od=__import__("collections").OrderedDict):
    if d > MAX_DEPTH:
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
        return {"t": [_enc(x, d + 1) for x in tuple.__iter__(v)]}
    if isinstance(v, _od):
        return {"od": [[_enc(k, d + 1), _enc(x, d + 1)] for k, x in _od.items(v)]}
    if isinstance(v, dict):
        return {"d": [[_enc(k, d + 1), _enc(x, d + 1)] for k, x in dict.items(v)]}
    if isinstance(v, frozenset):
        return {"fs": [_enc(x, d + 1) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"s": [_enc(x, d + 1) for x in set.__iter__(v)]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, complex):
        return {"c": [complex(v).real, complex(v).imag]}
    if hasattr(v, "tolist") and type(v).__module__.startswith("numpy"):
        return _enc(v.tolist(), d + 1)
    raise TypeError("cannot encode a " + type(v).__name__)
'''
_enc_ns: dict = {"MAX_DEPTH": MAX_DEPTH}
exec(compile(_ENC_SRC, "<judge-encoder>", "exec"), _enc_ns)


def encode_value(v: Any) -> Any:
    """The restricted JSON form of ``v`` (what the sandbox sends back for a probe)."""
    return _enc_ns["_enc"](v)


# --------------------------------------------------------------------------------------------
# Reading the values back (this side): bounded, collision-proof, never raises past parse_records
# --------------------------------------------------------------------------------------------
class _Bad(ValueError):
    pass


_SALT = secrets.token_bytes(16)  # keys the hash of set elements / dict keys: unknown to any program
_nan_counter = iter(range(1 << 62))


def _canon(v: Any) -> bytes:
    """A canonical byte form of a hashable decoded value: equal values (as Python's ``==`` sees them,
    1 == 1.0 == True, (1,) == (1.0,), frozenset order) have equal forms, and only those."""
    if v is None:
        return b"N"
    if isinstance(v, (bool, int)):
        return b"i" + format(int(v), "x").encode()
    if isinstance(v, float):
        if v != v:
            return b"n%d" % next(_nan_counter)  # NaN equals nothing (not even another NaN object)
        if v.is_integer():
            return b"i" + format(int(v), "x").encode()
        return b"f" + v.hex().encode()
    if isinstance(v, complex):
        if v.imag == 0:
            return _canon(v.real)
        return b"c" + _lp(_canon(v.real)) + _lp(_canon(v.imag))
    if isinstance(v, str):
        return b"s" + v.encode("utf-8", "surrogatepass")
    if isinstance(v, bytes):
        return b"b" + v
    if isinstance(v, tuple):
        return b"t" + b"".join(_lp(_canon(x)) for x in v)
    if isinstance(v, frozenset):
        return b"F" + b"".join(_lp(c) for c in sorted(x.c if isinstance(x, _Key) else _canon(x) for x in v))
    if isinstance(v, _Key):
        return v.c
    raise TypeError(f"unhashable type: {type(v).__name__}")


def _lp(b: bytes) -> bytes:
    return b"%d:" % len(b) + b


class _Key:
    """A set element or dict key: hashed with a keyed hash of its canonical form, equal iff canonical
    forms are equal (so a flood of values that hash alike in Python costs nothing)."""

    __slots__ = ("v", "c", "h")

    def __init__(self, v: Any):
        self.v = v
        self.c = _canon(v)
        self.h = int.from_bytes(hashlib.blake2b(self.c, key=_SALT, digest_size=8).digest(), "little")

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, _Key):
            return self.h == other.h and self.c == other.c
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self.v)


class _Budget:
    def __init__(self, n: int):
        self.left = n

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Bad("too many elements")


def decode_value(obj: Any, depth: int = 0, budget: _Budget | None = None) -> Any:
    """Rebuild a value from the restricted JSON format; raises ValueError/TypeError on anything else.

    Sets hold, and dict keys are, :class:`_Key` wrappers (compare with :func:`normalize`-d values)."""
    budget = budget or _Budget(MAX_ELEMENTS)
    budget.take()
    if depth > MAX_DEPTH + 2:
        raise _Bad("nested too deep")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode_value(x, depth + 1, budget) for x in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        (tag, payload), = obj.items()
        if tag == "b" and isinstance(payload, str):
            return bytes.fromhex(payload)
        if not isinstance(payload, list):
            raise _Bad("bad payload")
        if tag == "t":
            return tuple(decode_value(x, depth + 1, budget) for x in payload)
        if tag in ("s", "fs"):
            items = (_Key(decode_value(x, depth + 1, budget)) for x in payload)
            return set(items) if tag == "s" else frozenset(items)
        if tag == "c" and len(payload) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                    for x in payload):
            return complex(float(payload[0]), float(payload[1]))
        if tag in ("d", "od"):
            out = {} if tag == "d" else collections.OrderedDict()
            for kv in payload:
                if not isinstance(kv, list) or len(kv) != 2:
                    raise _Bad("bad dict item")
                out[_Key(decode_value(kv[0], depth + 1, budget))] = decode_value(kv[1], depth + 1, budget)
            return out
    raise _Bad("unknown value")


def normalize(v: Any) -> Any:
    """A literal (or any encodable value) in the decoded form, so that it compares with decoded values.
    A value that cannot be encoded is returned unchanged."""
    try:
        return decode_value(json.loads(json.dumps(encode_value(v))))
    except Exception:
        return v


@dataclass
class Records:
    program: str | None = None  # "ok", "exit", "error" or None (never got there)
    values: dict = field(default_factory=dict)  # probe index -> ("v", value) or ("e", error name)


def parse_records(stdout: str, tag: str, n_probes: int) -> Records:
    """The first record per probe index from a run's stdout (lines ``tag JSON``). Never raises and never
    stalls: a malformed line is ignored, a value that does not decode within the bounds is an error."""
    rec = Records()
    prefix = tag + " "
    try:
        lines = stdout.splitlines()
    except Exception:  # pragma: no cover - a str always splits
        return rec
    for line in lines:
        if not line.startswith(prefix):
            continue
        try:
            obj = json.loads(line[len(prefix):])
        except Exception:
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
            except Exception as exc:
                rec.values[i] = ("e", f"undecodable ({type(exc).__name__})")
        else:
            rec.values[i] = ("e", str(obj.get("e"))[:100])
    return rec


def _as_key(v: Any) -> Any:
    return v if isinstance(v, _Key) else _Key(v)


def _apply(v: Any, op: str, exp: Any, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
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
        if isinstance(exp, (set, frozenset, dict)):
            inside = _as_key(v) in exp
        else:
            inside = v in exp
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
        for x in (v, exp):
            if isinstance(x, bool) or not isinstance(x, (int, float, complex)):
                return False
        d = abs(v - exp)
        return d < abs_tol if op == "abs<" else d <= abs_tol
    raise ValueError(op)


def check_passes(check: Check, left: tuple, right: tuple | None) -> bool:
    """Does ``check`` hold for the side values ``left``/``right`` (each ("v", value) or ("e", error))?"""
    if left is None or left[0] != "v":
        return False
    if check.right is not None and (right is None or right[0] != "v"):
        return False
    try:
        return _apply(left[1], check.op, right[1] if right is not None else None, check.rel_tol, check.abs_tol)
    except Exception:
        return False


def _side_value(side: Side, prog: Records, ref: Records | None) -> tuple | None:
    if side.run == "literal":
        return ("v", side.value)
    recs = prog if side.run == "program" else ref
    if recs is None:
        return None
    return recs.values.get(side.index)


def unit_verdict(unit: TestUnit, prog: Records, ref: Records | None) -> tuple[bool, str]:
    """(passed, reason) of one supported unit from the program run's and the reference run's records."""
    if unit.unsupported is not None:
        return False, "unsupported: " + unit.unsupported
    if not unit.checks:
        return False, "no check"
    for c in unit.checks:
        lv = _side_value(c.left, prog, ref)
        rv = _side_value(c.right, prog, ref) if c.right is not None else None
        for side, val in ((c.left, lv), (c.right, rv)):
            if side is None:
                continue
            if val is None:
                return False, f"no value for {side.expr!r} ({side.run} run)"
            if val[0] != "v":
                who = "the program side" if side.run == "program" else "the expected side"
                return False, f"{who} {side.expr!r} raised {val[1]}"
        if not check_passes(c, lv, rv):
            return False, "failed"
    return True, "passed"


def stdout_matches(out: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(out) == norm(expected)


# --------------------------------------------------------------------------------------------
# The probe program (runs in the sandbox; only values leave it)
# --------------------------------------------------------------------------------------------
_HARNESS = r'''
import os as _os, sys as _sys, json as _json, signal as _signal
MAX_DEPTH = {depth}
{encoder}
def _harness(program, steps, tag, timeout):
    out = _os.dup(1)
    null = _os.open(_os.devnull, _os.O_RDWR)
    _os.dup2(null, 1)
    _os.dup2(null, 0)
    def emit(rec):
        try:
            line = (tag + " " + _json.dumps(rec) + "\n").encode()
        except Exception as e:
            bad = {{"i": rec.get("i"), "e": "unencodable: " + type(e).__name__}}
            line = (tag + " " + _json.dumps(bad) + "\n").encode()
        while line:
            line = line[_os.write(out, line):]
    class Timeout(BaseException):
        pass
    def alarm(signum, frame):
        raise Timeout()
    def timed(fn):
        _signal.signal(_signal.SIGALRM, alarm)
        _signal.setitimer(_signal.ITIMER_REAL, timeout)
        try:
            return fn()
        finally:
            _signal.setitimer(_signal.ITIMER_REAL, 0)
    ns = {{"__name__": "__solution__", "__builtins__": __builtins__}}
    try:
        exec(compile(program, "<program>", "exec"), ns)
        emit({{"program": "ok"}})
    except SystemExit as e:
        emit({{"program": "ok" if e.code in (None, 0) else "exit"}})
    except BaseException as e:
        emit({{"program": "error", "e": type(e).__name__}})
        _os._exit(0)
    for step in steps:
        if step[0] == "x":
            try:
                timed(lambda: exec(compile(step[1], "<setup>", "exec"), ns))
            except BaseException:
                pass
            continue
        try:
            v = timed(lambda: eval(compile(step[2], "<probe>", "eval"), ns))
            emit({{"i": step[1], "v": _enc(v)}})
        except BaseException as e:
            emit({{"i": step[1], "e": type(e).__name__}})
    _os._exit(0)
_harness({program!r}, {steps!r}, {tag!r}, {timeout!r})
'''


def build_probe_program(program: str, steps: Sequence[tuple], *, tag: str, test_timeout: float) -> str:
    """The sandbox script: runs ``program`` (empty: a reference run), then ``steps`` in its namespace:
    ``("x", src)`` setup statements, ``("p", index, expr)`` probes whose values it prints as ``tag JSON``
    lines on the original stdout (the program's own stdout goes to /dev/null). The script holds only
    what the steps say: for a program run, program-side code (see :func:`plan_tests`)."""
    return _HARNESS.format(program=program, steps=[list(s) for s in steps], tag=tag,
                           timeout=float(test_timeout), depth=MAX_DEPTH, encoder=_ENC_SRC)


def new_tag() -> str:
    return "grpo-judge-" + secrets.token_hex(8)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args) -> None:
    with _warned_lock:
        if key in _warned or len(_warned) > 200:
            return
        _warned.add(key)
    logger.warning(message, *args)
