"""The code sandbox against hostile programs: each is contained and scores 0, and the caller goes on.

A module fixture checks afterwards that no sandbox process is left behind and that no file outside
the sandbox was created (every hostile program writes a per-session canary name).
"""

from __future__ import annotations

import ast
import fcntl
import os
import secrets
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest

from grpo_variants.rewards import SandboxPool, code_pass, make_code_reward, run_in_sandbox, sandbox_capabilities
from grpo_variants.rewards import sandbox as sb

CAPS = sandbox_capabilities()
TOKEN = secrets.token_hex(6)
CANARY = f"grpo_canary_{TOKEN}"
REPO = Path(__file__).resolve().parents[1]
# Places a program might try to leave a file: the repo, $HOME, /tmp, the sandbox's parent
# directories, other world-writable directories.
OUTSIDE_DIRS = sorted(
    {
        str(REPO),
        str(REPO / "tests"),
        os.path.expanduser("~"),
        "/tmp",
        "/var/tmp",
        "/dev/shm",
        "/run/lock",
        str(sb._sandbox_base()),
        str(sb._sandbox_base().parent),
        "/",
    }
)

pytestmark = pytest.mark.skipif(CAPS["python"] is None, reason="no interpreter the sandbox user can run")
needs_uid = pytest.mark.skipif(
    not CAPS["uid_drop"], reason="needs a dedicated sandbox uid (root parent): RLIMIT_NPROC does not bind root"
)


def _sandbox_uid_pids() -> dict[int, int]:
    """pid -> uid for every live, non-zombie process running as one of the sandbox uids."""
    uids = set(CAPS["uids"])
    out = {}
    if not uids:
        return out
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            uid, _ = sb._proc_uid_sid(entry)
            if uid in uids and not sb._is_zombie(int(entry)):
                out[int(entry)] = uid
    return out


def _stray_processes() -> list[int]:
    """Sandbox-uid processes whose uid slot is *not* held by a running sandbox (in any process)."""
    strays = []
    for pid, uid in _sandbox_uid_pids().items():
        fd = os.open(sb._uid_lock_dir() / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)  # the slots' own lock dir
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run (ours or another test session's) holds it
        else:
            if os.path.exists(f"/proc/{pid}") and not sb._is_zombie(pid):
                strays.append(pid)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return strays


def _canaries() -> list[str]:
    found = [os.path.join(d, CANARY) for d in OUTSIDE_DIRS if os.path.lexists(os.path.join(d, CANARY))]
    return found


@pytest.fixture(scope="module", autouse=True)
def nothing_leaks():
    assert not _canaries()
    yield
    leaked, strays = _canaries(), _stray_processes()
    for path in leaked:  # clean up before failing
        try:
            os.unlink(path)
        except OSError:
            pass
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not leaked, f"files created outside the sandbox: {leaked}"
    assert not strays, f"sandbox processes left behind: {strays}"
    # No file owned by a sandbox uid in the world-writable directories either.
    uids = set(CAPS["uids"])
    owned = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        try:
            for e in os.scandir(d):
                try:
                    if e.stat(follow_symlinks=False).st_uid in uids:
                        owned.append(e.path)
                except OSError:
                    pass
        except OSError:
            pass
    assert not owned, f"files owned by the sandbox user outside the sandbox: {owned}"


def _score(code: str, **options) -> float:
    """The code_pass score of ``code`` followed by a correct solution: 1 when the run goes on normally
    after ``code``, 0 when what ``code`` did (crash, kill, timeout, ...) stops it."""
    completion = f"```python\n{code}\n\ndef answer():\n    return 42\n```"
    reward = make_code_reward("all", **options) if options else code_pass
    return reward(prompts=["p"], completions=[completion], tests=[["assert answer() == 42"]])[0]


def _dedent(s: str) -> str:
    return textwrap.dedent(s).strip() + "\n"


# ---------------------------------------------------------------------------------------------
def test_normal_program_and_limits_reported():
    r = run_in_sandbox("import sys; print('hello'); print('err', file=sys.stderr); sys.exit(3)")
    assert (r.returncode, r.stdout, r.stderr.strip(), r.timed_out, r.killed_reason) == (3, "hello\n", "err", False, None)
    r = run_in_sandbox("print(input())", stdin="from stdin\n")
    assert r.ok and r.stdout == "from stdin\n"
    r = run_in_sandbox("import resource as R; print(R.getrlimit(R.RLIMIT_NPROC)[0], R.getrlimit(R.RLIMIT_CORE)[0])",
                       max_processes=16)
    assert r.ok, r.stderr
    if CAPS["uid_drop"]:
        assert r.stdout.split() == ["16", "0"]


def test_infinite_loop_is_killed_at_the_wall_timeout():
    t0 = time.monotonic()
    r = run_in_sandbox("while True:\n    pass", timeout=1.0, cpu_time=30)
    assert r.timed_out and r.killed_reason == "timeout" and not r.ok
    assert time.monotonic() - t0 < 3.0
    assert _score("while True:\n    pass", timeout=1.0) == 0.0


def test_cpu_time_limit():
    r = run_in_sandbox("while True:\n    pass", timeout=20.0, cpu_time=1)
    assert r.killed_reason == "cpu_time" and not r.timed_out, r  # SIGXCPU after 1 s of CPU


def test_sleeping_past_the_timeout():
    t0 = time.monotonic()
    r = run_in_sandbox("import time\ntime.sleep(30)\nprint('woke')", timeout=1.0)
    assert r.timed_out and "woke" not in r.stdout
    assert time.monotonic() - t0 < 3.0
    assert _score("import time\ntime.sleep(30)", timeout=1.0) == 0.0


@needs_uid
def test_fork_bomb_is_contained():
    # First verify the containment (a bounded number of forks) before running a real bomb.
    probe = _dedent(
        """
        import os, time
        n = 0
        for _ in range(64):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            n += 1
        print(n, flush=True)
        """
    )
    r = run_in_sandbox(probe, max_processes=16, timeout=10)
    assert r.ok, r.stderr
    assert 0 < int(r.stdout.split()[0]) < 16  # the interpreter and its init count against the 16
    assert not _stray_processes()

    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run_in_sandbox(bomb, max_processes=16, timeout=1.5, cpu_time=3)
    assert r.timed_out and not r.ok
    assert time.monotonic() - t0 < 6.0
    assert not _stray_processes()
    assert _score(bomb, max_processes=16, timeout=1.5) == 0.0
    assert run_in_sandbox("print('alive')").stdout == "alive\n"  # the caller goes on


def test_memory_bomb():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    r = run_in_sandbox(bomb, memory_mb=256, timeout=10)
    assert not r.ok and r.killed_reason == "memory", r
    assert r.duration < 5.0
    assert _score(bomb, memory_mb=256) == 0.0


def test_huge_output_is_capped():
    spam = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    r = run_in_sandbox(spam, max_output_bytes=64_000, timeout=10)
    assert r.killed_reason == "output_limit" and r.output_truncated
    assert len(r.stdout) <= 64_000 and r.duration < 5.0
    assert _score(spam, max_output_bytes=64_000) == 0.0


@needs_uid
def test_writing_outside_its_directory():
    targets = OUTSIDE_DIRS + [".."]
    prog = _dedent(
        f"""
        import os
        ok = []
        for d in {targets!r}:
            p = os.path.join(d, {CANARY!r})
            try:
                with open(p, "w") as f:
                    f.write("pwned")
                ok.append(p)
            except OSError as e:
                print("blocked", p, type(e).__name__)
        # a symlink out of the sandbox, and writing through it
        try:
            os.symlink({str(REPO / CANARY)!r}, "link")
            open("link", "w").write("pwned")
            ok.append("link")
        except OSError as e:
            print("blocked link", type(e).__name__)
        print("WROTE", ok, flush=True)
        assert os.path.exists({str(REPO / CANARY)!r})
        """
    )
    r = run_in_sandbox(prog, timeout=10)
    assert r.returncode != 0 and "AssertionError" in r.stderr, (r.stdout, r.stderr)
    assert "blocked" in r.stdout
    assert not _canaries(), (r.stdout, _canaries())
    assert _score(prog) == 0.0
    assert not _canaries()
    # The run's own working directory is gone afterwards (its own: another xdist worker's runs share the base).
    made = []
    real_mkdtemp = sb.tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    sb.tempfile.mkdtemp = recording_mkdtemp
    try:
        r = run_in_sandbox("import os\nopen('f', 'w').write('x')\nprint(os.getcwd())")
    finally:
        sb.tempfile.mkdtemp = real_mkdtemp
    runs = [d for d in made if Path(d).parent == sb._sandbox_base()]
    assert r.ok and runs and not any(os.path.exists(d) for d in runs), runs


def test_secrets_in_the_environment_are_not_visible(monkeypatch):
    secret = f"s3cr3t-{TOKEN}"
    monkeypatch.setenv("GRPO_FAKE_API_KEY", secret)
    prog = _dedent(
        f"""
        import os
        print(dict(os.environ))
        for path in ("/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ", "/proc/1/environ"):
            try:
                print(path, open(path, "rb").read())
            except OSError as e:
                print(path, type(e).__name__)
        assert any("s3cr3t" in v for v in os.environ.values())
        """
    )
    r = run_in_sandbox(prog, timeout=10)
    assert secret not in r.stdout and secret not in r.stderr
    assert "GRPO_FAKE_API_KEY" not in r.stdout
    assert set(ast.literal_eval(r.stdout.splitlines()[0])) <= set(sb.SANDBOX_ENV) | {"HOME", "TMPDIR", "PWD"}
    assert _score(prog) == 0.0


@pytest.mark.skipif(not CAPS["netns"], reason="no network namespace on this machine")
def test_network_connection_fails():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        prog = _dedent(
            f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
            s.sendall(b"exfiltrated")
            print("CONNECTED")
            """
        )
        r = run_in_sandbox(prog, timeout=10)
        assert "CONNECTED" not in r.stdout and r.returncode != 0
        assert "OSError" in r.stderr or "Error" in r.stderr
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conn, _ = listener.accept()
            conn.close()
        assert _score(prog) == 0.0
    finally:
        listener.close()


@needs_uid
def test_killing_its_parent():
    me = os.getpid()
    prog = _dedent(
        f"""
        import os, signal
        for target in ({me}, os.getppid()):
            try:
                os.kill(target, signal.SIGKILL)
                print("kill", target, "sent", flush=True)
            except OSError as e:
                print("kill", target, type(e).__name__, flush=True)
        for pgid in ({os.getpgid(0)}, os.getpgid(os.getppid()) if os.getppid() > 1 else 0):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError as e:
                print("killpg", pgid, type(e).__name__, flush=True)
        try:
            os.kill(-1, signal.SIGKILL)  # everything this uid may signal
        except OSError as e:
            print("kill -1", type(e).__name__, flush=True)
        os.killpg(0, signal.SIGKILL)  # its own group: it dies here
        """
    )
    r = run_in_sandbox(prog, timeout=10)
    assert f"kill {me} sent" not in r.stdout  # EPERM (other uid) or ESRCH (other PID namespace)
    assert r.returncode == -signal.SIGKILL and "Traceback" not in r.stderr, r  # it killed only itself
    os.kill(me, 0)  # we are alive
    assert _score(prog) == 0.0
    assert not _stray_processes()
    assert run_in_sandbox("print('still here')").stdout == "still here\n"


def test_background_child_does_not_survive():
    prog = _dedent(
        """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.setsid()
                try:
                    os.setpgid(0, 0)
                except OSError:
                    pass
                sys.stdout.write("daemon %d\\n" % os.getpid()); sys.stdout.flush()
                time.sleep(30)
                os._exit(0)
            os._exit(0)
        time.sleep(0.2)
        print("parent exits")
        """
    )
    t0 = time.monotonic()
    r = run_in_sandbox(prog, timeout=10)
    assert time.monotonic() - t0 < 5.0, "the run waited for the daemon"
    assert "parent exits" in r.stdout and r.returncode == 0
    assert not _stray_processes()
    if CAPS["uid_drop"]:
        time.sleep(0.1)
        assert not _stray_processes()


@needs_uid
def test_cleanup_without_namespaces(monkeypatch):
    """With no namespaces at all ("process" mode), the dedicated uid still reaps a setsid daemon."""
    monkeypatch.setattr(sb, "_caps", dict(CAPS, mode="process", **sb._mode_flags("process", True)))
    prog = _dedent(
        """
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.setsid() if os.getpid() != os.getsid(0) else None
                print("daemon", os.getpid(), flush=True)
                time.sleep(30)
                os._exit(0)
            os._exit(0)
        time.sleep(0.2)
        """
    )
    t0 = time.monotonic()
    r = run_in_sandbox(prog, timeout=10)
    assert time.monotonic() - t0 < 5.0
    daemon = int(r.stdout.split()[1])
    assert not os.path.exists(f"/proc/{daemon}") or sb._is_zombie(daemon)
    assert not _stray_processes()
    me = os.getpid()
    r = run_in_sandbox(f"import os, signal\nos.kill({me}, signal.SIGKILL)")
    assert "PermissionError" in r.stderr  # another uid cannot signal us
    os.kill(me, 0)


def test_pool_runs_in_order_and_survives_hostile_neighbours():
    codes = ["print(1)", "while True: pass", "print(3)", "import os; os.killpg(0, 9)", "print(5)"]
    with SandboxPool(max_workers=3, timeout=1.5) as pool:
        results = pool.run_many(codes)
    assert [r.stdout.strip() for r in results[::2]] == ["1", "3", "5"]
    assert results[1].timed_out and not results[3].ok
    assert all(r.ok for r in results[::2])
    assert not _stray_processes()


def test_capabilities_are_reported():
    caps = sandbox_capabilities()
    for key in ("netns", "mountns", "pidns", "ipcns", "uid_drop", "python", "uids", "warnings"):
        assert key in caps
    if os.geteuid() == 0:
        assert caps["uid_drop"], caps["warnings"]


# ---------------------------------------------------------------------------------------------
# Faked passes: a wrong solution plus a trick must score 0 under both code rewards (issue #18)
# ---------------------------------------------------------------------------------------------
WRONG = "def f(x):\n    return 0\n"  # the tests want f(3) == 6 and f(5) == 10
HACKS = {
    "always_true_eq": _dedent(
        """
        class Anything:
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = object.__hash__
        class Int(int):
            __eq__ = lambda self, other: True
        def f(x):
            return Anything() if x == 3 else Int(0)
        """
    ),
    "noop_exec": WRONG
    + "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n",
    "patched_compile": WRONG + _dedent(
        """
        import builtins
        _real = builtins.compile
        def _compile(src, name, mode, *a, **k):
            return _real("True" if mode == "eval" else "pass", name, mode)
        builtins.compile = _compile
        """
    ),
    "overwrite_harness_tests": WRONG + _dedent(
        """
        import __main__
        for name in list(vars(__main__)):
            value = getattr(__main__, name)
            if isinstance(value, list) and name != "__builtins__":
                value[:] = [["p", i, "True"] for i in range(4)]
        __main__._TESTS = ["pass"]
        """
    ),
    "forged_result_line": WRONG + _dedent(
        """
        import os, sys, json
        frame, g = sys._getframe(), {}
        while frame is not None:
            g.update(frame.f_globals)
            frame = frame.f_back
        tag = g.get("_TAG") or ""
        fd = g.get("_OUT", 1)
        for i in range(8):
            for v in (True, 6, 10):
                os.write(fd, (tag + " " + json.dumps({"i": i, "v": v}) + "\\n").encode())
        os.write(fd, (tag + ' {"program": "ok"}\\n').encode())
        nonce = sys.stdin.readline().strip()
        sys.stdout.write("\\n%s 2 2\\n" % nonce)
        sys.stdout.flush()
        os._exit(0)
        """
    ),
    "wrapped_stdout_write": WRONG + _dedent(
        """
        import os, sys, re
        _w, _sw = os.write, sys.stdout.write
        def w(fd, data):
            return _w(fd, re.sub(rb'"(v|e)": [^}]*', b'"v": true', bytes(data)))
        os.write = w
        sys.stdout.write = lambda s: _sw(re.sub(r" 0 (\\d+)$", r" \\1 \\1", s))
        """
    ),
    "read_expected_from_harness": _dedent(
        """
        import gc, sys, re
        def _candidates():
            frame = sys._getframe()
            while frame is not None:
                yield from frame.f_globals.values()
                frame = frame.f_back
            yield from gc.get_objects()
            try:
                yield open("main.py").read()
            except OSError:
                pass
        def f(x):
            for obj in _candidates():
                for s in (obj if isinstance(obj, (list, tuple)) else [obj]):
                    if isinstance(s, str):
                        m = re.search(r"f\\(%d\\)\\s*==\\s*(\\d+)" % x, s)
                        if m:
                            return int(m.group(1))
                    if isinstance(s, (list, tuple)) and len(s) == 2 and s[0] == ("f(%d)" % x):
                        return s[1]
            return 0
        """
    ),
}
HACK_TESTS = ["assert f(3) == 6", "assert f(5) == 10"]


@pytest.mark.parametrize("name", sorted(HACKS))
def test_faked_pass_scores_zero(name):
    code = HACKS[name]
    reward_all = make_code_reward("all")
    reward_frac = make_code_reward("fraction")
    for completion in (f"```python\n{code}```", [{"role": "assistant", "content": f"```python\n{code}```"}]):
        assert reward_all(prompts=["p"], completions=[completion], tests=[HACK_TESTS]) == [0.0], name
        assert reward_frac(prompts=["p"], completions=[completion], tests=[HACK_TESTS]) == [0.0], name


def test_expected_values_never_reach_the_program():
    """The program searches everything it can see (its script, every string in memory, stdin, env, and,
    where the host is hidden, the file a dataset with the gold answers would be in) for the secret
    expected value and returns it; it finds it nowhere."""
    secret = f"gold-{secrets.token_hex(8)}"
    dataset = REPO / f".pytest_dataset_{TOKEN}.json"
    dataset.write_text('{"tests": ["assert solve() == %r"]}' % secret)
    # Without a hidden host (modes other than bwrap) a world-readable dataset file is readable: documented.
    paths = [str(dataset)] if CAPS["host_hidden"] else []
    try:
        prog = _dedent(
            f"""
            import gc, os, re, sys
            def solve():
                pattern = re.compile("gold" + "-[0-9a-f]{{16}}")  # not spelled out in this source
                seen = [open("main.py").read(), sys.stdin.read() if not sys.stdin.closed else "", str(os.environ)]
                seen += [o for o in gc.get_objects() if isinstance(o, str)]
                for path in {paths!r} + ["/proc/self/cmdline", "/proc/1/cmdline", "/proc/self/environ"]:
                    try:
                        seen.append(open(path, errors="replace").read())
                    except OSError:
                        pass
                for s in seen:
                    m = pattern.search(s)
                    if m:
                        return m.group(0)
                return "nothing found"
            """
        )
        assert "gold-" not in prog.replace('"gold" + "-', "")
        tests = [[f"assert solve() == {secret!r}"]]
        reward = make_code_reward("all")
        assert reward(prompts=["p"], completions=[prog], tests=tests) == [0.0]
        # Sanity: the same search does find a value that is really there (here, in its own source).
        planted = prog.replace("def solve():", f"PLANTED = {secret!r}\ndef solve():")
        assert reward(prompts=["p"], completions=[planted], tests=tests) == [1.0]
        if CAPS["host_hidden"]:
            r = run_in_sandbox(f"import os\nprint(os.path.exists({str(dataset)!r}), os.path.exists({str(REPO)!r}))")
            assert r.stdout.split() == ["False", "False"], r
    finally:
        dataset.unlink()


def test_correct_solution_scores_one_plain_and_chat():
    sol = "def f(x):\n    return 2 * x\n\ndef pair(x):\n    return (x, [x] * 2)\n"
    tests = [
        "assert f(3) == 6",
        "assert 10 == f(5)",
        "assert pair(1) == (1, [1, 1])",
        "assert f(2) in {4, 5}",
        "assert f(0) is not None",
        "import math\nassert math.isclose(f(0.1), 0.2, rel_tol=1e-9)",
        "assert abs(f(0.25) - 0.5) < 1e-9",
        "assert f(1) == [2][0] * 1",  # needs the reference run
        "import math\nassert f(4) == int(math.sqrt(64))",
        "assert not f(0)",
        "assert f(1) and f(2) == 4",
    ]
    plain = f"Here you go:\n```python\n{sol}```\nDone."
    chat = [{"role": "user", "content": "write f"}, {"role": "assistant", "content": f"```python\n{sol}```"}]
    for reward in (make_code_reward("all"), make_code_reward("fraction")):
        assert reward(prompts=["p", "p"], completions=[plain, chat], tests=[tests, tests]) == [1.0, 1.0]
    wrong = "```python\ndef f(x):\n    return x + 1\n\ndef pair(x):\n    return [x, [x, x]]\n```"
    frac = make_code_reward("fraction")(prompts=["p"], completions=[wrong], tests=[tests])[0]
    assert 0.0 < frac < 1.0  # f(1) == 2 holds, f(3) == 6 does not; a list is not a tuple


def test_stdin_stdout_cases():
    sol = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"
    wrong = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a * b)\n```"
    forge = "```python\nimport sys\nprint('5')\nsys.stdout.write = lambda s: None\n```"
    cases = {"inputs": ["2 3\n", "10 20\n"], "outputs": ["5\n", "30"]}
    items = [{"input": "2 3\n", "output": "5"}, {"input": "1 1", "output": "2\n\n"}]
    reward = make_code_reward("fraction")
    assert reward(prompts=["p"] * 3, completions=[sol, wrong, forge], tests=[cases] * 3) == [1.0, 0.0, 0.5]
    assert make_code_reward("all")(prompts=["p"] * 2, completions=[sol, wrong], tests=[items] * 2) == [1.0, 0.0]


def test_unsupported_test_form_is_a_clear_error():
    from grpo_variants.errors import DatasetError

    tests = [["assert f(lambda i: 2 * i) == 2"]]  # a function of the tests never crosses to the program
    with pytest.raises(DatasetError, match="unsupported test .the test passes a function to the program"):
        make_code_reward("all")(prompts=["p"], completions=["def f(x): return 2 * x"], tests=tests)
    lenient = make_code_reward("all", on_unsupported="fail")
    assert lenient(prompts=["p"], completions=["def f(x): return 2 * x"], tests=tests) == [0.0]


def test_decoder_accepts_only_the_restricted_format():
    from grpo_variants.rewards import harness

    def no_handle(i):
        raise ValueError("no handles here")

    assert harness.decode({"t": [1, {"s": [2]}, {"d": [["k", {"b": "00ff"}]]}]}, no_handle) == \
        (1, {2}, {"k": b"\x00\xff"})
    for bad in ({"py/object": "os.system"}, {"t": 1}, {"x": []}, {"d": [[[1], 2]]}, {"h": 0}):
        with pytest.raises((ValueError, TypeError)):
            harness.decode(bad, no_handle)


# ---------------------------------------------------------------------------------------------
# The host filesystem, the footprint of a run, reaping
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not CAPS["ro_host"], reason=f"mode {CAPS['mode']!r}: the host is writable for the program")
def test_deep_world_writable_directory_stays_untouched():
    top = REPO / f".pytest_ww_{TOKEN}"
    deep = top / "a" / "b" / "ww"
    deep.mkdir(parents=True)
    wfile = top / "a" / "ww_file"
    wfile.write_text("original")
    for p in (top, top / "a", top / "a" / "b", deep):
        os.chmod(p, 0o777)
    os.chmod(wfile, 0o666)
    try:
        prog = _dedent(
            f"""
            import os
            wrote = []
            for p in ({str(deep / CANARY)!r}, {str(wfile)!r}):
                try:
                    with open(p, "a") as f:
                        f.write("pwned")
                    wrote.append(p)
                except OSError:
                    pass
            # every directory of the visible filesystem
            for root, dirs, files in os.walk("/"):
                if root.startswith(("/proc", "/sys")):
                    dirs[:] = []
                    continue
                try:
                    fd = os.open(os.path.join(root, {CANARY!r}), os.O_CREAT | os.O_WRONLY, 0o600)
                    os.close(fd)
                    os.unlink(os.path.join(root, {CANARY!r}))
                    wrote.append(root)
                except OSError:
                    pass
            print("WROTE", sorted(wrote))
            """
        )
        r = run_in_sandbox(prog, timeout=60, cpu_time=60)
        assert r.ok, r.stderr
        writable = set(ast.literal_eval(r.stdout.split("WROTE", 1)[1].strip()))
        assert not (deep / CANARY).exists() and wfile.read_text() == "original"
        allowed = {"/tmp", "/dev/shm", "/sandbox", "/var/tmp"} if CAPS["mode"] == "bwrap" else None
        if allowed is not None:
            assert writable <= allowed | {d for d in writable if d.startswith(("/tmp/", "/sandbox/"))}, writable
        else:  # "namespaces": only the run's own tmpfs (its directory and the /tmp-like binds)
            assert all(d.startswith(str(sb._sandbox_base())) or d in ("/tmp", "/var/tmp", "/dev/shm")
                       or d.startswith(("/tmp/", "/var/tmp/", "/dev/shm/")) for d in writable), writable
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_children_holding_memory_stay_under_the_total_limit():
    prog = _dedent(
        """
        import os, sys, time
        kids = []
        for k in range(6):
            pid = os.fork()
            if pid == 0:
                block = bytearray(150 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                os.write(1, b"held\\n")
                time.sleep(5)
                os._exit(0)
            kids.append(pid)
            time.sleep(0.2)
        survived = 0
        for pid in kids:
            survived += os.waitpid(pid, 0)[1] == 0
        print("survived", survived, flush=True)
        """
    )
    r = run_in_sandbox(prog, memory_mb=400, total_memory_mb=400, timeout=20, max_processes=16)
    # The six children overlap in time; at most two can hold 150 MB each at once within 400 MB, so
    # either the run was ended, or at least four children were killed.
    if "survived" in r.stdout:
        assert int(r.stdout.split("survived")[1]) <= 400 // 150, r
    else:
        assert not r.ok, r
    if CAPS["cgroup"]:
        assert r.peak_memory_mb is not None and r.peak_memory_mb <= 400, r


def test_polling_fallback_limits_total_memory(monkeypatch):
    """Without a cgroup the trainer polls the run's resident memory and kills it above the total."""
    monkeypatch.setattr(sb, "_caps", dict(CAPS, _cgroups=None))
    prog = _dedent(
        """
        import os, time
        for k in range(6):
            if os.fork() == 0:
                block = bytearray(150 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(10)
                os._exit(0)
            time.sleep(0.4)
        time.sleep(10)
        """
    )
    r = run_in_sandbox(prog, memory_mb=400, total_memory_mb=400, timeout=20, max_processes=16)
    assert r.killed_reason == "memory" and r.duration < 10, r


@pytest.mark.skipif(not CAPS["inode_cap"], reason="the inode cap of the tmpfs needs root")
def test_tmpfs_inode_cap():
    prog = _dedent(
        """
        import os
        n = 0
        for d in (".", "/tmp"):
            try:
                while n < 100000:
                    open(os.path.join(d, "f%d" % n), "w").close()
                    n += 1
            except OSError as e:
                print("stopped", d, n, e.errno, flush=True)
        print("made", n)
        """
    )
    r = run_in_sandbox(prog, max_files=500, timeout=20)
    assert r.ok, r.stderr
    assert int(r.stdout.split("made")[1]) < 500, r.stdout  # one tmpfs for the workdir and /tmp


_REAPER_SCRIPT = r"""
import ctypes, json, os, sys, time
import importlib.util
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us, as to a PID 1
# The sandbox module alone (stdlib only): no need to import torch and TRL with the package.
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sb = sys.modules["sandbox_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)
run_in_sandbox = sb.run_in_sandbox
rs = [run_in_sandbox("import time\ntime.sleep(30)", timeout=0.5),
      run_in_sandbox("import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(30)\nprint(1)"),
      run_in_sandbox("while True: pass", timeout=0.5)]
time.sleep(0.3)
zombies = []
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            st = open("/proc/%s/stat" % e).read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        if int(f[1]) == os.getpid():
            zombies.append((int(e), f[0]))
print(json.dumps({"timed_out": [r.timed_out for r in rs], "children": zombies}))
"""


@pytest.mark.skipif(not CAPS["pidns"] and not CAPS["uid_drop"],
                    reason="'process' mode without root: a setsid daemon escapes cleanup (documented)")
def test_no_zombie_left_when_the_trainer_is_a_reaper():
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    module = REPO / "grpo_variants" / "rewards" / "sandbox.py"
    out = subprocess.run([sys.executable, "-c", _REAPER_SCRIPT, str(module)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["timed_out"] == [True, False, True]
    assert res["children"] == [], res  # neither zombies nor live children: every process was reaped


def test_humaneval_check_function_and_nested_asserts():
    from grpo_variants.rewards import judge

    src = _dedent(
        """
        METADATA = {}
        def check(candidate):
            assert candidate(1, 2) == 3
            assert candidate(0, 0) == 0, "zero"
            for i in range(3):
                assert candidate(i, i) == 2 * i
        check(add)
        """
    )
    parsed = judge.parse_tests(src)
    assert parsed.source == src and not parsed.cases and not parsed.unparsable
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a * b\n```"  # add(0, 0) == 0 holds, the rest does not
    reward = make_code_reward("fraction")
    assert reward(prompts=["p"] * 2, completions=[good, wrong], tests=[src] * 2) == [1.0, 0.0]  # check(add): one test
    assert "check(add)" in reward.last_reasons[1][0]
