"""The judge of the code rewards: the tests run as Python in a program-free process; the program only
answers calls.

**Invariant (by construction).** A sample's assert-style tests run as one Python file, unmodified, in
the *tests' process* (a sandbox that never holds the program); every name the program defines is bound
there to a stub. Calling a stub sends the call's **arguments, as values**, to the *program's process*
(another sandbox, which never holds the tests) and waits for the answer: the return value and the
arguments' values after the call, copied back in place. Nothing else ever crosses: not the tests'
namespace, not a container an argument came from, not the other side of a comparison. Python decides
every assert, ``except``, ``match``, ``global``, star import, chained comparison and unittest case,
because Python runs them. An argument that is an instance of a plain class of the test file (a
``ListNode``, a ``TreeNode``) crosses as the object graph it reaches (:class:`harness.Graph`), is rebuilt
as the program's class of that name and copied back in place; the program's instances of a class the
test file defines come back the same way, as the test's class. Any other value of the program that is
not plain data comes back as a *handle*
whose method calls and attribute reads go to the program; comparing, hashing or searching a handle is
never forwarded (it would ship the other side to the program) and fails the test.

The processes never talk directly: this module relays each line (:func:`run_session`), so it measures
the program's own time (start-up and answers, not the tests') and bounds every wait. Values cross in
:mod:`grpo_variants.rewards.harness`'s bounded JSON encoding (the code both sandboxes run).

Test formats (the dataset's ``tests`` column; one sample's tests are a list of items or one string):

* **Test code** (strings, joined in order into one file). Each top-level statement that holds an
  ``assert`` (or calls a function of the file that does, as HumanEval's ``check(candidate)``) is one
  test; each ``unittest.TestCase`` method is one test; each ``test_*`` function nobody calls is one
  test (pytest style). Other statements are setup: one that fails counts as one failed test (Python
  would stop there). An item that does not parse is an unsupported test.
* **stdin/stdout cases**: a dict ``{"input": str, "output": str}`` as an item, or the whole column
  value ``{"inputs": [...], "outputs": [...]}`` (APPS/CodeContests style). The program runs once per
  case with that stdin; it passes when it exits with status 0 and its stdout equals the expected
  output up to trailing whitespace on each line and trailing blank lines.

Refused (*unsupported*, handled by the reward's ``on_unsupported``): a test that passes the program
something that is not data (a function, an object of the tests whose class is not plain), an item that
does not parse.
"""

from __future__ import annotations

import ast
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_variants.errors import DatasetError
from grpo_variants.rewards import harness
from grpo_variants.rewards.sandbox import Channel, SandboxResult, run_in_sandbox

logger = logging.getLogger(__name__)

__all__ = ["parse_tests", "Tests", "StdioCase", "stdout_matches", "ReferenceServer", "Session", "Program",
           "run_session", "program_script", "REFERENCE_SCRIPT", "warn_once"]

_HARNESS = Path(harness.__file__).read_text()
REFERENCE_SCRIPT = _HARNESS + "\nserve_tests()\n"


def program_script(program: str, test_timeout: float) -> str:
    """The program's sandbox script: the harness, then the program executed by :func:`harness.serve_program`."""
    return _HARNESS + f"\nserve_program({program!r}, {float(test_timeout)!r})\n"


@dataclass
class StdioCase:
    input: str
    output: str


@dataclass
class Tests:
    """A sample's tests: the test file (None: no test code), its stdin/stdout cases, items that do not parse."""

    source: str | None
    cases: list[StdioCase] = field(default_factory=list)
    unparsable: list[tuple[str, str]] = field(default_factory=list)  # (item, why)

    @property
    def empty(self) -> bool:
        return self.source is None and not self.cases and not self.unparsable


def _as_text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "\n".join(str(x) for x in v)
    return "" if v is None else str(v)


def _items(tests: Any) -> list[Any]:
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


def parse_tests(tests: Any) -> Tests:
    """A sample's ``tests`` column value as one test file, its stdin/stdout cases and its unparsable items."""
    out = Tests(None)
    code: list[str] = []
    for item in _items(tests):
        if isinstance(item, StdioCase):
            out.cases.append(item)
        elif isinstance(item, dict):
            if "input" in item and "output" in item:
                out.cases.append(StdioCase(_as_text(item["input"]), _as_text(item["output"])))
                continue
            raise DatasetError(f"A test dict needs 'input' and 'output' keys, got {sorted(item)}.")
        else:
            text = str(item)
            try:
                ast.parse(text)
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
                out.unparsable.append((text, f"does not parse: {exc}"))
                continue
            code.append(text if text.endswith("\n") else text + "\n")
    out.source = "".join(code) or None
    return out


def stdout_matches(out: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(out) == norm(expected)


# --------------------------------------------------------------------------------------------
# The tests' process: a server that runs one test file at a time (a forked child each)
# --------------------------------------------------------------------------------------------
class ReferenceServer:
    """One program-free sandbox running :func:`harness.serve_tests`; ``ready`` is its start-up time."""

    def __init__(self, run_options: dict, lifetime: float):
        self.channel = Channel()
        self.started = time.monotonic()
        self.lifetime = float(lifetime)
        self.ready: float | None = None
        self.broken = False
        self.result: SandboxResult | None = None
        opts = {**run_options, "timeout": self.lifetime}
        self._thread = threading.Thread(target=self._run, args=(opts,), daemon=True, name="grpo-judge-tests")
        self._thread.start()

    def _run(self, opts: dict) -> None:
        self.result = run_in_sandbox(REFERENCE_SCRIPT, channel=self.channel, **opts)

    def wait_ready(self, deadline: float) -> bool:
        if self.ready is None and not self.broken:
            line = self.channel.readline(deadline)
            if line == b"READY":
                self.ready = time.monotonic() - self.started
            else:
                self.close()
        return self.ready is not None and not self.broken

    def close(self, reason: str = "finished") -> None:
        self.broken = True
        if reason == "finished":
            self.channel.finish()
        else:
            self.channel.stop(reason)
        self._thread.join(timeout=15)


@dataclass
class Session:
    """What one completion's test file gave: each test's ``(kind, label, why)`` (kind ``pass``, ``fail`` or
    ``unsupported``), the program's own seconds, its sandbox result, and why the tests' run failed if it did."""

    units: list[tuple[str, str, str]] = field(default_factory=list)
    program_seconds: float = 0.0
    result: SandboxResult | None = None
    reference_failed: str | None = None
    gone: str | None = None


def _manifest_ok(line: bytes) -> bool:
    try:
        m = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(m, dict) and isinstance(m.get("program"), str) and isinstance(m.get("names"), dict)


GRACE = 0.5  # seconds the tests' process gets past the ceiling to report, once the program is gone


class Program:
    """A program's sandbox, launched now (its start-up overlaps the tests' process's); it ends by
    ``ceiling`` seconds after its launch whatever happens."""

    def __init__(self, program: str, run_options: dict, test_timeout: float, ceiling: float):
        self.ch = Channel()
        self.box: dict = {}
        opts = {**run_options, "timeout": ceiling + 0.5}
        script = program_script(program, test_timeout)

        def run():
            self.box["r"] = run_in_sandbox(script, channel=self.ch, **opts)

        self.thread = threading.Thread(target=run, daemon=True, name="grpo-judge-program")
        self.t0 = time.monotonic()
        self.end = self.t0 + ceiling
        self.thread.start()

    def close(self) -> SandboxResult | None:
        self.ch.finish()
        self.thread.join(timeout=max(1.0, self.end - time.monotonic()) + 5)
        return self.box.get("r")


def run_session(program: "str | Program", source: str, ref: ReferenceServer, *, run_options: dict, budget: float,
                test_timeout: float, ceiling: float) -> Session:
    """Run ``source`` (a test file) in ``ref`` against ``program`` (launched here if a str), relaying each line.

    The program is charged its start-up (from its launch to its first line) and the time it takes to answer
    (``budget`` in all); the whole session ends by ``ceiling`` seconds after the program's launch whatever
    either side does. Every wait here has a deadline."""
    s = Session()
    if isinstance(program, str):
        program = Program(program, run_options, test_timeout, ceiling)
    ch, t0, end = program.ch, program.t0, program.end

    def charge(deadline_of_answer):
        return min(end, time.monotonic() + max(0.0, budget - s.program_seconds)) if deadline_of_answer else end

    # The tests' side has until ``end``; once the program is gone (its budget may end at ``end`` itself, with
    # time_factor=None), GRACE more to hear so and report, rather than be taken for a failed tests' process.
    tests_end = [end]

    def lose(why: str) -> None:
        s.gone = s.gone or why
        tests_end[0] = min(end + GRACE, max(end, time.monotonic() + GRACE))
        ch.stop("timeout" if "budget" in why or "timeout" in why else "finished")

    def spent(start: float) -> None:
        s.program_seconds += time.monotonic() - start

    manifest = None

    def ready() -> bytes:  # the program's manifest: its start-up, from its launch to its first line, is charged
        line = ch.readline(min(end, t0 + budget))
        s.program_seconds += min(time.monotonic(), ch.first_line_at or time.monotonic()) - t0
        if line is None or not _manifest_ok(line):
            lose("spent its time budget before it was ready" if s.program_seconds >= budget - 1e-3 else
                 "sent no result (it crashed, was killed or garbled its result stream)")
            line = json.dumps({"program": s.gone, "names": {}}).encode()
        return line

    try:
        if not ref.channel.write(b"N" + json.dumps([source, float(test_timeout)]).encode() + b"\n", tests_end[0]):
            s.reference_failed = "the tests' process did not take the file"
        while s.reference_failed is None:
            line = ref.channel.readline(tests_end[0])
            if line is None:
                s.reference_failed = ("the tests ran past the timeout" if time.monotonic() >= tests_end[0]
                                      else "the tests' process ended")
                break
            kind, body = line[:1], line[1:]
            if kind == b"C":
                try:
                    req = json.loads(body)
                except ValueError:
                    req = None
                if isinstance(req, dict) and req.get("o") == "hello":
                    manifest = manifest or ready()
                    answer = b"R" + manifest
                elif s.gone:
                    answer = b"X" + s.gone.encode()
                else:
                    start = time.monotonic()
                    deadline = charge(True)
                    got = ch.readline(deadline) if ch.write(body + b"\n", deadline) else None
                    spent(start)
                    if got is None:
                        lose(f"spent its time budget of {budget:.2f} s" if s.program_seconds >= budget - 1e-3
                             else f"was stopped at the timeout ({ceiling:g} s after its launch)"
                             if time.monotonic() >= end - 1e-3
                             else "stopped answering (it crashed, was killed or closed its pipe)")
                        answer = b"X" + s.gone.encode()
                    else:
                        answer = b"R" + got
                if not ref.channel.write(answer + b"\n", tests_end[0]):
                    s.reference_failed = "the tests' process stopped reading"
            elif kind == b"U":
                try:
                    k, label, why = json.loads(body)
                    s.units.append((str(k), str(label), str(why)))
                except (ValueError, TypeError):
                    s.reference_failed = "garbled result from the tests' process"
            elif kind == b"E":
                if body.strip() not in (b"0", b""):
                    s.reference_failed = "the tests' process crashed (%s)" % body[:80].decode(errors="replace")
                break
    finally:
        s.result = program.close()
        if s.reference_failed is not None:
            ref.close("reference_failed")
    return s


class ReferencePool:
    """The tests' processes of one reward call: ``n`` servers, each serving one session at a time; a server
    that failed is replaced (started afresh) by the next session that needs one. They start at once;
    :meth:`wait_ready` (called by the first :meth:`take`) waits ``ready_within`` at most from then."""

    def __init__(self, n: int, run_options: dict, lifetime: float, ready_within: float):
        self.run_options, self.lifetime, self.ready_within = run_options, lifetime, ready_within
        self.free: queue.Queue = queue.Queue()
        self.all = [ReferenceServer(run_options, lifetime) for _ in range(n)]
        self._deadline = time.monotonic() + ready_within
        self._lock = threading.Lock()
        self._waited = False

    def wait_ready(self) -> None:
        with self._lock:
            if not self._waited:
                self._waited = True
                for r in self.all:
                    r.wait_ready(self._deadline)
                    self.free.put(r)

    @property
    def startup(self) -> float | None:
        times = [r.ready for r in self.all if r.ready is not None]
        return min(times) if times else None

    def take(self) -> ReferenceServer | None:
        self.wait_ready()
        r = self.free.get()
        if r.broken:
            r = ReferenceServer(self.run_options, self.lifetime)
            self.all.append(r)
            r.wait_ready(time.monotonic() + self.ready_within)
        return r if not r.broken else self.put_back(r)

    def put_back(self, r: ReferenceServer) -> None:
        self.free.put(r)

    def close(self) -> None:
        for r in self.all:
            if not r.broken:
                r.close()


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args) -> None:
    with _warned_lock:
        if key in _warned or len(_warned) > 200:
            return
        _warned.add(key)
    logger.warning(message, *args)
