"""Run model-generated Python code, which is hostile input, in a contained child process.

Public API::

    run_in_sandbox(code, *, timeout=5.0, cpu_time=5, memory_mb=512, max_processes=32,
                   max_output_bytes=64_000, stdin=None, ...) -> SandboxResult
    SandboxPool(max_workers=None, **run_options).run_many(codes, stdins=None) -> list[SandboxResult]
    sandbox_capabilities() -> dict   # which containment mechanisms work on this machine

How a run is contained (each layer is detected once per process by a probe child; a layer that
does not work here is skipped with one logged warning, never silently):

* **Process**: the program runs under a small launcher (``python -I -S -c``) started in a new
  session (``start_new_session``) with a scrubbed, minimal environment (no parent variables, so
  no secrets). The parent reads stdout/stderr through a cap (``max_output_bytes``, the run is
  killed when a stream exceeds it), kills the whole process group with SIGKILL at the wall-clock
  ``timeout``, and scans ``/proc`` afterwards for stragglers (see *cleanup*).
* **Limits** (``setrlimit`` in the launcher before ``exec``): RLIMIT_CPU (``cpu_time`` s),
  RLIMIT_AS (``memory_mb``), RLIMIT_FSIZE (``max_file_mb``), RLIMIT_NPROC (``max_processes``
  tasks, threads included), RLIMIT_CORE = 0, RLIMIT_NOFILE.
* **Unprivileged uid** (when the parent runs as root; RLIMIT_NPROC does not bind root): each run
  takes a *dedicated* uid/gid from a range (default 61000-61255, ``GRPO_SANDBOX_UID_BASE`` /
  ``GRPO_SANDBOX_UID_SLOTS``; uids listed in /etc/passwd are skipped), held with an ``flock`` so
  that concurrent runs, in this process or others, never share one. So NPROC bounds a fork bomb
  per run, the program cannot signal the trainer (EPERM), cannot read or write the trainer's
  files beyond world-readable ones, and every process of that uid belongs to this run: cleanup
  kills them all, even a daemon that called ``setsid`` again. ``PR_SET_NO_NEW_PRIVS`` blocks
  set-uid binaries.
* **Namespaces** (root only here; ``unshare`` via ctypes): a new *network* namespace (only a
  loopback that is down: every connection fails), a new *mount* namespace in which the
  world-writable directories (/tmp, /var/tmp, /dev/shm, /run/lock, ...) are replaced by small
  private tmpfs (found by a scan two levels deep) and the working directory is a size-capped
  tmpfs (so the program leaves no file on the host, given the uid drop, and disk use is bounded),
  and a new *PID* namespace with a tiny init
  (the launcher's child) whose exit makes the kernel kill every process left in it, and a fresh
  /proc that shows only the sandbox's processes; and a new *IPC* namespace (SysV shared memory
  and semaphores die with the run instead of piling up on the host).
* **Working directory**: a fresh directory under a private base (``GRPO_SANDBOX_DIR``, default
  ``$TMPDIR/grpo_variants_sandbox_<uid>``, owned by the parent, mode 0711) is created per run
  and removed afterwards; the program's ``HOME`` and ``TMPDIR`` point into it. ``stdin`` is fed
  through a pipe (the program cannot seek back and re-read it).

The interpreter is the first of ``sys.executable``, its real path, ``python3`` on PATH and
/usr/bin/python3 that the sandbox uid can execute (a venv under a 0700 home is not), or
``python=``; ``sandbox_capabilities()["python"]`` says which.

Residual risks (documented, not solved): without the mount namespace the program can create files
in world-writable directories (/tmp) as its uid; files readable by everyone (the repository, the
venv) are readable; without a dedicated uid (non-root parent) cleanup relies on the session id,
which a double fork plus ``setsid`` escapes; CPU-time and memory limits are per process (NPROC
bounds the number of processes); the kernel itself is the trust boundary (no seccomp filter).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "SandboxResult",
    "SandboxPool",
    "run_in_sandbox",
    "sandbox_capabilities",
    "SANDBOX_ENV",
]

# The whole environment a sandboxed program sees (plus HOME and TMPDIR, set per run).
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # BLAS/OpenMP start one thread per core by default; threads count against RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# World-writable directories hidden behind private tmpfs mounts in the mount namespace.
_WORLD_WRITABLE_CANDIDATES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")

_LAUNCHER_EXIT = 125  # the launcher failed to set the sandbox up (never the program's own code)
_LAUNCHER_TAG = "[grpo-sandbox]"


@dataclass
class SandboxResult:
    """What one sandboxed run did.

    ``returncode`` is the program's exit status (negative: killed by that signal; None: never
    started). ``killed_reason`` is None for a normal exit, else one of ``"timeout"`` (wall clock),
    ``"cpu_time"``, ``"memory"``, ``"output_limit"``, ``"sandbox_error"``, ``"signal:SIGNAME"``.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration: float
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 on its own."""
        return self.returncode == 0 and not self.timed_out and self.killed_reason is None


# --------------------------------------------------------------------------------------------
# The launcher: runs as the parent's user (root here) in a fresh interpreter, sets up the
# containment, drops privileges and execs the program. Kept free of imports beyond the stdlib
# core so that it starts fast with ``python -I -S``.
# --------------------------------------------------------------------------------------------
_LAUNCHER = r"""
import os, sys, json, ctypes, resource, signal
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x40000000, 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
TAG = "[grpo-sandbox]"
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

def die(stage, detail):
    os.write(2, ("%s %s failed: %s\n" % (TAG, stage, detail)).encode())
    os._exit(125)

def errstr():
    return os.strerror(ctypes.get_errno())

def enc(s):
    return None if s is None else s.encode()

def mount(src, tgt, fstype, flags, data=None):
    if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
        return errstr()
    return None

def unshare(flags):
    return None if libc.unshare(flags) == 0 else errstr()

def drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        die("privilege drop", "setuid(0) still works")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)

def set_limits():
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))

def trial(fn):
    pid = os.fork()
    if pid == 0:
        try:
            ok = fn()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, st = os.waitpid(pid, 0)
    return os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0

if cfg.get("probe"):
    res = {}
    res["netns"] = trial(lambda: unshare(CLONE_NEWNET) is None)
    res["ipcns"] = trial(lambda: unshare(CLONE_NEWIPC) is None)
    def mount_trial():
        if unshare(CLONE_NEWNS) is not None:
            return False
        if mount(None, "/", None, MS_REC | MS_PRIVATE) is not None:
            return False
        return mount("tmpfs", cfg["probe_dir"], "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") is None
    res["mountns"] = trial(mount_trial)
    def pid_trial():
        if unshare(CLONE_NEWPID | CLONE_NEWNS) is not None:
            return False
        pid = os.fork()
        if pid == 0:
            ok = os.getpid() == 1
            ok = ok and mount(None, "/", None, MS_REC | MS_PRIVATE) is None
            ok = ok and mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC) is None
            os._exit(0 if ok else 1)
        _, st = os.waitpid(pid, 0)
        return os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    res["pidns"] = trial(pid_trial)
    def uid_trial():
        drop_privileges(cfg["uid"], cfg["gid"])
        return os.getuid() == cfg["uid"]
    res["uid_drop"] = cfg["uid"] is not None and trial(uid_trial)
    def python_trial(python):
        def run():
            if res["uid_drop"]:
                drop_privileges(cfg["uid"], cfg["gid"])
            os.chdir("/")
            fd = os.open(os.devnull, os.O_RDWR)
            os.dup2(fd, 1); os.dup2(fd, 2)
            os.execve(python, [python, "-I", "-c", "import sys"], cfg["env"])
        return trial(run)
    res["python"] = next((p for p in cfg["pythons"] if python_trial(p)), None)
    sys.stdout.write(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)

wd = cfg["workdir"]
fd = os.open(os.path.join(wd, "main.py"), os.O_RDONLY | os.O_NOFOLLOW)
with os.fdopen(fd, "rb") as f:
    script = f.read()
flags = (CLONE_NEWNET if cfg["netns"] else 0) | (CLONE_NEWNS if cfg["mountns"] else 0)
flags |= (CLONE_NEWPID if cfg["pidns"] else 0) | (CLONE_NEWIPC if cfg["ipcns"] else 0)
if flags:
    e = unshare(flags)
    if e:
        die("unshare", e)

status_w = None
if cfg["pidns"]:
    r, status_w = os.pipe()
    init_pid = os.fork()
    if init_pid:
        # The launcher (outside the PID namespace): relay the program's exit status, read from
        # the init's status pipe, as our own so that the parent sees it unchanged.
        os.close(status_w)
        data = b""
        while True:
            chunk = os.read(r, 64)
            if not chunk:
                break
            data += chunk
        _, st = os.waitpid(init_pid, 0)
        if data.strip():
            st = int(data)
        if os.WIFSIGNALED(st):
            sig = os.WTERMSIG(st)
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # SIGKILL/SIGSTOP: always default
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 125)
    os.close(r)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

uid, gid = cfg["uid"], cfg["gid"]
if cfg["mountns"]:
    e = mount(None, "/", None, MS_REC | MS_PRIVATE)
    if e:
        die("making / private", e)
    for d in cfg["tmpfs_dirs"]:
        e = mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=1777" % cfg["tmpfs_mb"])
        if e:
            die("tmpfs on " + d, e)
    os.makedirs(wd, 0o755, exist_ok=True)
    opts = "size=%dm,mode=0700" % cfg["workdir_mb"]
    if uid is not None:
        opts += ",uid=%d,gid=%d" % (uid, gid)
    e = mount("tmpfs", wd, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    if e:
        die("tmpfs on the working directory", e)
    with open(os.path.join(wd, "main.py"), "wb") as f:
        f.write(script)
    if uid is not None:
        os.chown(os.path.join(wd, "main.py"), uid, gid)
    if cfg["pidns"]:
        e = mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if e:
            die("mounting /proc", e)
os.chdir(wd)
set_limits()
if uid is not None:
    drop_privileges(uid, gid)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a credential change cleared it
os.umask(0o077)
argv = [cfg["python"], "-I", "-B", "-X", "utf8", "main.py"]
if status_w is None:
    os.execve(argv[0], argv, cfg["env"])
# PID 1 of the namespace: start the program, reap orphans until it exits, report its status.
prog = os.fork()
if prog == 0:
    os.execve(argv[0], argv, cfg["env"])
while True:
    try:
        p, st = os.wait()
    except ChildProcessError:
        st = 125 << 8
        break
    if p == prog:
        break
os.write(status_w, str(st).encode())
os._exit(0)
"""


# --------------------------------------------------------------------------------------------
# Capabilities probe, base directory, uid slots
# --------------------------------------------------------------------------------------------
_caps_lock = threading.Lock()
_caps: dict | None = None
_base_dir: Path | None = None


def _is_root() -> bool:
    return os.geteuid() == 0


def _sandbox_base() -> Path:
    """A root-owned (mode 0711) directory holding run directories and uid lock files."""
    global _base_dir
    if _base_dir is not None:
        return _base_dir
    base = Path(os.environ.get("GRPO_SANDBOX_DIR") or Path(tempfile.gettempdir()) / f"grpo_variants_sandbox_{os.getuid()}")
    base.mkdir(mode=0o711, exist_ok=True)
    st = base.lstat()
    if st.st_uid != os.getuid() or not os.path.isdir(base) or os.path.islink(base):
        raise RuntimeError(
            f"Sandbox base directory {base} is not a directory owned by uid {os.getuid()}; remove it or "
            "set GRPO_SANDBOX_DIR to a private directory."
        )
    os.chmod(base, 0o711)  # the sandbox uid may traverse into its own run directory, not list or write here
    (base / "locks").mkdir(mode=0o700, exist_ok=True)
    _base_dir = base
    return base


def _uid_range() -> list[int]:
    start = int(os.environ.get("GRPO_SANDBOX_UID_BASE", "61000"))
    n = int(os.environ.get("GRPO_SANDBOX_UID_SLOTS", "256"))
    out = []
    for uid in range(start, start + n):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            out.append(uid)  # not a real user: ours to use
    return out


def _python_candidates() -> list[str]:
    cands = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3") or "", "/usr/bin/python3"]
    out: list[str] = []
    for c in cands:
        if c and c not in out and os.path.exists(c):
            out.append(c)
    return out


def sandbox_capabilities() -> dict:
    """Which containment layers work here (probed once per process, warnings logged once).

    Keys: ``netns``, ``mountns``, ``pidns``, ``uid_drop`` (bools), ``python`` (the interpreter that
    the sandbox user can run), ``uids`` (the dedicated uid range, empty without uid drop),
    ``tmpfs_dirs`` (world-writable directories hidden in the mount namespace), ``warnings``.
    """
    global _caps
    with _caps_lock:
        if _caps is not None:
            return _caps
        base = _sandbox_base()
        uids = _uid_range() if _is_root() else []
        probe_dir = tempfile.mkdtemp(prefix="probe_", dir=base)
        cfg = {
            "probe": True,
            "probe_dir": probe_dir,
            "uid": uids[0] if uids else None,
            "gid": uids[0] if uids else None,
            "pythons": _python_candidates(),
            "env": dict(SANDBOX_ENV, HOME="/", TMPDIR="/tmp"),
        }
        try:
            out = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                capture_output=True, timeout=60, env=dict(SANDBOX_ENV), start_new_session=True,
            )
            res = json.loads(out.stdout.decode() or "{}")
        except (subprocess.TimeoutExpired, ValueError) as exc:  # pragma: no cover - broken platform
            res = {"error": repr(exc)}
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
        caps = {
            "netns": bool(res.get("netns")),
            "ipcns": bool(res.get("ipcns")),
            "mountns": bool(res.get("mountns")),
            "pidns": bool(res.get("pidns")) and bool(res.get("mountns")),
            "uid_drop": bool(res.get("uid_drop")),
            "python": res.get("python"),
            "is_root": _is_root(),
        }
        caps["uids"] = uids if caps["uid_drop"] else []
        caps["tmpfs_dirs"] = _world_writable_dirs() if caps["mountns"] else []
        warnings = []
        if not caps["uid_drop"]:
            warnings.append(
                "no dedicated sandbox uid (parent is not root or setuid failed): RLIMIT_NPROC counts all of this "
                "user's processes, the program can signal this process, and stray-process cleanup relies on the "
                "session id"
            )
        if not caps["netns"]:
            warnings.append("no network namespace: sandboxed programs can open network connections")
        if not caps["mountns"]:
            warnings.append("no mount namespace: sandboxed programs can create files in world-writable directories")
        if not caps["pidns"]:
            warnings.append("no PID namespace: a daemonised child that calls setsid may escape cleanup without a uid")
        if caps["python"] is None:
            warnings.append(
                f"no Python interpreter runnable by the sandbox user among {cfg['pythons']}; sandboxed runs will fail"
            )
        for w in warnings:
            logger.warning("grpo-variants sandbox: %s", w)
        caps["warnings"] = warnings
        _caps = caps
        return caps


def _world_writable_dirs() -> list[str]:
    found: list[str] = []

    def check(p: str) -> None:
        try:
            st = os.lstat(p)
        except OSError:
            return
        import stat as _stat

        if _stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and p not in found:
            found.append(p)

    for p in _WORLD_WRITABLE_CANDIDATES:
        if os.path.isdir(p) and not os.path.islink(p):
            check(p)
    # A shallow scan for other world-writable directories (depth 2, skipping kernel filesystems).
    for top in ("/",):
        try:
            entries = os.listdir(top)
        except OSError:
            entries = []
        for e in entries:
            p1 = os.path.join(top, e)
            if e in ("proc", "sys", "dev") or os.path.islink(p1) or not os.path.isdir(p1):
                continue
            check(p1)
            try:
                for e2 in os.listdir(p1):
                    p2 = os.path.join(p1, e2)
                    if not os.path.islink(p2):
                        check(p2)
            except OSError:
                pass
    # Never mount over an ancestor of another entry twice: keep the outermost only.
    found.sort(key=len)
    out: list[str] = []
    for p in found:
        if not any(p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


class _UidSlot:
    """An flock-held dedicated uid: no other run (in any process) uses it while held."""

    _next = 0
    _next_lock = threading.Lock()

    def __init__(self, uids: list[int]):
        self.uid: int | None = None
        self._fd: int | None = None
        if not uids:
            return
        locks = _sandbox_base() / "locks"
        deadline = time.monotonic() + 120
        while True:
            with _UidSlot._next_lock:
                start = _UidSlot._next
                _UidSlot._next = (_UidSlot._next + 1) % len(uids)
            for k in range(len(uids)):
                uid = uids[(start + k) % len(uids)]
                fd = os.open(locks / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                # A previous holder that crashed may have left processes behind: they are ours.
                _kill_matching(uid=uid, sid=None)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"All {len(uids)} sandbox uids stay busy; raise GRPO_SANDBOX_UID_SLOTS.")
            time.sleep(0.01)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


# --------------------------------------------------------------------------------------------
# Process scans
# --------------------------------------------------------------------------------------------
def _proc_uid_sid(pid: str) -> tuple[int | None, int | None]:
    uid = sid = None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    uid = int(line.split()[1])
                    break
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        sid = int(stat[stat.rindex(b")") + 2 :].split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return uid, sid


def _matching_pids(uid: int | None, sid: int | None) -> list[int]:
    out = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        puid, psid = _proc_uid_sid(entry)
        if (uid is not None and puid == uid) or (sid is not None and psid == sid):
            out.append(int(entry))
    return out


def _kill_matching(uid: int | None, sid: int | None, wait_s: float = 2.0) -> int:
    """SIGKILL every process with real uid ``uid`` or session ``sid``; wait until they are gone."""
    if uid is None and sid is None:
        return 0
    killed = 0
    deadline = time.monotonic() + wait_s
    while True:
        pids = _matching_pids(uid, sid)
        # Zombies are gone for all practical purposes (their parent, in the sandbox, reaps or dies).
        pids = [p for p in pids if not _is_zombie(p)]
        if not pids:
            return killed
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
            except PermissionError:  # pragma: no cover - not ours after all
                pass
        if time.monotonic() > deadline:
            logger.warning("grpo-variants sandbox: processes %s survived SIGKILL for %.1fs", pids, wait_s)
            return killed
        time.sleep(0.005)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------
def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def run_in_sandbox(
    code: str,
    *,
    timeout: float = 5.0,
    cpu_time: int = 5,
    memory_mb: int = 512,
    max_processes: int = 32,
    max_output_bytes: int = 64_000,
    stdin: str | bytes | None = None,
    max_file_mb: int = 16,
    workdir_mb: int = 64,
    max_open_files: int = 256,
    network: bool = False,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` (a Python program) in the sandbox; never raises for anything the program does.

    ``timeout`` is wall-clock seconds, after which the whole process group (and, with a dedicated
    uid or PID namespace, every process the program started) is killed. ``cpu_time`` is
    RLIMIT_CPU seconds per process, ``memory_mb`` RLIMIT_AS per process, ``max_processes``
    RLIMIT_NPROC (tasks of the sandbox uid, threads included), ``max_output_bytes`` the cap on
    each of stdout and stderr (the run is killed when exceeded), ``max_file_mb`` RLIMIT_FSIZE,
    ``workdir_mb`` the size of the tmpfs working directory (mount namespace only). ``network=True``
    skips the network namespace. ``env`` adds variables to the minimal :data:`SANDBOX_ENV`.
    """
    caps = sandbox_capabilities()
    start = time.monotonic()
    py = python or caps["python"]
    if py is None:
        return SandboxResult(None, "", "no Python interpreter usable by the sandbox user", False, "sandbox_error", 0.0)
    slot = _UidSlot(caps["uids"]) if caps["uid_drop"] else _UidSlot([])
    workdir = Path(tempfile.mkdtemp(prefix="run_", dir=_sandbox_base()))
    proc: subprocess.Popen | None = None
    cleaned = False
    try:
        main = workdir / "main.py"
        main.write_text(code, encoding="utf-8", errors="surrogatepass")
        if slot.uid is not None and not caps["mountns"]:
            # The program works in this directory. (With the mount namespace it works in a private
            # tmpfs instead, and this directory stays root's: the program never sees it.)
            os.chown(workdir, slot.uid, slot.uid)
            os.chown(main, slot.uid, slot.uid)
        os.chmod(workdir, 0o700)
        cpu = max(1, int(cpu_time))
        nofile = max(16, int(max_open_files))
        rlimits = [
            ("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_AS", int(memory_mb) << 20, int(memory_mb) << 20),
            ("RLIMIT_FSIZE", int(max_file_mb) << 20, int(max_file_mb) << 20),
            ("RLIMIT_NPROC", int(max_processes), int(max_processes)),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NOFILE", nofile, nofile),
        ]
        if slot.uid is None and _is_root():
            rlimits = [r for r in rlimits if r[0] != "RLIMIT_NPROC"]  # would be a no-op for root anyway
        prog_env = dict(SANDBOX_ENV)
        prog_env.update(env or {})
        prog_env.update(HOME=str(workdir), TMPDIR=str(workdir))
        cfg = {
            "workdir": str(workdir),
            "netns": caps["netns"] and not network,
            "ipcns": caps["ipcns"],
            "mountns": caps["mountns"],
            "pidns": caps["pidns"],
            "tmpfs_dirs": caps["tmpfs_dirs"],
            "tmpfs_mb": 16,
            "workdir_mb": int(workdir_mb),
            "uid": slot.uid,
            "gid": slot.uid,
            "rlimits": rlimits,
            "python": py,
            "env": prog_env,
        }
        stdin_r = None
        if stdin is not None:
            # A pipe, not a file: once read, the program cannot seek back and read it again.
            data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
            stdin_r, stdin_w = os.pipe()
            threading.Thread(target=_feed, args=(stdin_w, data), daemon=True, name="grpo-sandbox-stdin").start()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                stdin=stdin_r if stdin_r is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(SANDBOX_ENV),
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
        finally:
            if stdin_r is not None:
                os.close(stdin_r)
        stdout, stderr, timed_out, over, truncated = _collect(proc, start + timeout, max_output_bytes)
        if timed_out or over:
            _killpg(proc.pid)
        # Wait for the launcher to exit *without reaping it*, so that its pid (our process group and
        # session id) cannot be reused while we kill what the program left behind.
        while not _exited_nowait(proc.pid):
            if time.monotonic() >= start + timeout:
                timed_out = True
                _killpg(proc.pid)
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                break
            time.sleep(0.002)
        _killpg(proc.pid)
        _kill_matching(uid=slot.uid, sid=proc.pid)
        rc = proc.wait()
        cleaned = True
        out_s = stdout.decode("utf-8", errors="replace")
        err_s = stderr.decode("utf-8", errors="replace")
        reason = None
        if timed_out:
            reason = "timeout"
        elif over:
            reason = "output_limit"
        elif rc == _LAUNCHER_EXIT and _LAUNCHER_TAG in err_s:
            reason = "sandbox_error"
            logger.warning("grpo-variants sandbox setup failed: %s", err_s.strip()[-500:])
        elif rc is not None and rc < 0:
            reason = "cpu_time" if -rc == signal.SIGXCPU else f"signal:{_signame(-rc)}"
        elif rc and "MemoryError" in err_s[-2000:]:
            reason = "memory"
        return SandboxResult(
            returncode=rc,
            stdout=out_s,
            stderr=err_s,
            timed_out=timed_out,
            killed_reason=reason,
            duration=time.monotonic() - start,
            output_truncated=truncated,
        )
    finally:
        if proc is not None:
            if proc.returncode is None:  # an exception above: make sure nothing survives
                _killpg(proc.pid)
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if not cleaned:
            _kill_matching(uid=slot.uid, sid=None)
        shutil.rmtree(workdir, ignore_errors=True)
        slot.release()


def _feed(fd: int, data: bytes) -> None:
    """Write ``data`` to the program's stdin pipe, then close it (EOF); a program that exits early is fine."""
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError:  # BrokenPipe: the program is gone
        pass
    finally:
        os.close(fd)


def _exited_nowait(pid: int) -> bool:
    """Has child ``pid`` exited? Leaves it a zombie (WNOWAIT) so that its pid stays reserved."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool, bool]:
    """Read stdout/stderr up to ``cap`` bytes each until EOF, exit, deadline or overflow."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = over = truncated = False
    exited_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and _exited_nowait(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > 0.05:
                # The program exited but something (a background child) holds the pipes open.
                break
            for key, _ in sel.select(timeout=min(0.05, max(0.0, deadline - now))):
                fd = key.fd
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if len(data) > room:
                    buf += data[: max(0, room)]
                    over = truncated = True
                else:
                    buf += data
            if over:
                break
    finally:
        sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, over, truncated


# --------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------
def _reinit_locks_after_fork() -> None:
    # A fork (e.g. RobustReward's process isolation) may happen while another thread holds one.
    global _caps_lock
    _caps_lock = threading.Lock()
    _UidSlot._next_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_locks_after_fork)


class SandboxPool:
    """Run many programs in parallel sandboxes (one thread per concurrent run; work is in processes).

    ``run_options`` are :func:`run_in_sandbox` keyword arguments applied to every run; ``run_many``
    may override them per call. Results come back in input order.
    """

    def __init__(self, max_workers: int | None = None, **run_options):
        self.max_workers = max(1, int(max_workers or min(8, os.cpu_count() or 1)))
        self.run_options = run_options
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():  # forked: the parent's worker threads do not exist here
            self._lock, self._executor, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grpo-sandbox")
            return self._executor

    def run(self, code: str, **overrides) -> SandboxResult:
        return run_in_sandbox(code, **{**self.run_options, **overrides})

    def run_many(
        self, codes: Sequence[str], stdins: Sequence[str | bytes | None] | None = None, **overrides
    ) -> list[SandboxResult]:
        codes = list(codes)
        if stdins is not None and len(stdins) != len(codes):
            raise ValueError(f"run_many got {len(codes)} programs but {len(stdins)} stdins.")
        opts = {**self.run_options, **overrides}
        if not codes:
            return []
        sandbox_capabilities()  # probe once, outside the worker threads
        if self.max_workers == 1 or len(codes) == 1:
            return [run_in_sandbox(c, stdin=stdins[i] if stdins else None, **opts) for i, c in enumerate(codes)]
        futs = [
            self._pool().submit(run_in_sandbox, c, stdin=stdins[i] if stdins else None, **opts)
            for i, c in enumerate(codes)
        ]
        return [f.result() for f in futs]

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
