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
        fd = os.open(sb._sandbox_base() / "locks" / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
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
    """The code_pass score of ``code`` against a test that any well-behaved program passes."""
    completion = f"```python\n{code}\n```"
    reward = make_code_reward("all", **options) if options else code_pass
    return reward(prompts=["p"], completions=[completion], tests=[["assert True"]])[0]


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
    # The run's own working directory is gone afterwards.
    r = run_in_sandbox("import os\nopen('f', 'w').write('x')\nprint(os.getcwd())")
    workdir = r.stdout.strip()
    assert r.ok and workdir.startswith(str(sb._sandbox_base())) and not os.path.exists(workdir)


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
    assert set(ast.literal_eval(r.stdout.splitlines()[0])) <= set(sb.SANDBOX_ENV) | {"HOME", "TMPDIR"}
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
    """With the PID and mount namespaces unavailable, the dedicated uid still reaps a setsid daemon."""
    monkeypatch.setattr(sb, "_caps", dict(CAPS, pidns=False, mountns=False, netns=False, tmpfs_dirs=[]))
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
