"""Run model-generated Python code, which is hostile input, in a contained child process.

Public API::

    run_in_sandbox(code, *, timeout=5.0, cpu_time=5, memory_mb=512, total_memory_mb=None,
                   max_processes=32, max_output_bytes=64_000, stdin=None, ...) -> SandboxResult
    SandboxPool(max_workers=None, **run_options).run_many(codes, stdins=None) -> list[SandboxResult]
    sandbox_capabilities() -> dict   # which containment this machine gives (probed once, warned once)

This module only *runs* programs; it decides nothing about a score. Code rewards judge the values a
run sends back outside the program's reach (see :mod:`grpo_variants.rewards.judge`).

How a run is contained
======================
A run is a chain of processes, each exec'ing the next::

    trainer --Popen--> stub (python -I -S, as the trainer's user)  --exec-->  bwrap  -->  python main.py

The **stub** (``_STUB``, ~80 lines) does only what bubblewrap cannot: it joins the run's cgroup, sets
the rlimits, and (as root) mounts the run's inode-capped tmpfs in a private mount namespace, then drops
to the run's dedicated uid and execs **bubblewrap** (Debian package ``bubblewrap``, the sandbox under
Flatpak), which builds the namespaces and the minimal root:

* ``--unshare-all --unshare-user --disable-userns``: new user, mount, PID, network (only a loopback
  that is down), IPC, UTS and cgroup namespaces; no nested user namespaces.
* A **minimal root**: ``/usr`` and the ``/bin``, ``/lib*`` links read-only, ``/etc/ld.so.cache`` and
  ``/etc/localtime``, the interpreter's prefix (when outside ``/usr``) and any ``ro_paths``; a fresh
  ``/proc`` (only the run's processes) and a minimal ``/dev``. Nothing else of the host exists inside:
  no home, no project, no datasets, no ``/tmp``. The root and ``/dev`` are remounted read-only; the
  only writable places are the working directory ``/sandbox`` and ``/tmp`` = ``/dev/shm`` (one tmpfs).
* ``--die-with-parent`` (the run dies with the trainer), ``--new-session`` (no TIOCSTI on the
  trainer's terminal), ``--cap-drop ALL``; bubblewrap's PID 1 reaps every orphan inside and its exit
  kills everything left in the namespace.

Around it, from the trainer's side:

* **Dedicated uid** (trainer is root): each run takes its own uid/gid from a range (default
  61000-61255, ``GRPO_SANDBOX_UID_BASE`` / ``GRPO_SANDBOX_UID_SLOTS``; uids in /etc/passwd are
  skipped), held with an ``flock`` so that concurrent runs never share one: RLIMIT_NPROC binds per
  run, the program cannot signal the trainer, and every process of that uid belongs to the run.
* **Total memory and process count** (``total_memory_mb``, default ``memory_mb``; ``max_processes``):
  one cgroup per run, cgroup v2 (``memory.max``, ``memory.swap.max = 0``, ``pids.max``) where the
  trainer can create one with both controllers, else cgroup v1 (``memory``; ``pids`` too
  when there is no dedicated uid: with one, RLIMIT_NPROC already bounds exactly the run's processes,
  and each v1 hierarchy joined costs a migration).
  Every process of the run is in it from its start (the stub joins before anything forks); the
  kernel's OOM killer ends the run at the limit (``killed_reason="memory"``), tmpfs pages included.
  *Fallback* without a usable cgroup: the trainer sums the resident memory of the run's processes
  every 50 ms and kills the run above the limit (a fast allocator can overshoot between two polls,
  by at most RLIMIT_AS per process), and RLIMIT_NPROC bounds the processes (per uid: only with a
  dedicated uid).
* **rlimits** (set by the stub): RLIMIT_CPU (``cpu_time`` s per process), RLIMIT_AS (``memory_mb``
  per process), RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_CORE = 0.
* **tmpfs caps**: the working tmpfs has ``size=workdir_mb`` and ``nr_inodes=max_files`` (mounted by
  the stub, root only: bubblewrap's ``--tmpfs`` takes a size but no inode cap).
* **Output**: stdout and stderr are read through a cap (``max_output_bytes``; the run is killed when
  a stream exceeds it); the environment is :data:`SANDBOX_ENV` only (no secrets); stdin is a pipe.
* **Cleanup and reaping**: at exit, timeout or overflow the trainer kills the namespace's PID 1
  (through a pidfd, so a recycled pid is never hit; the kernel then kills the whole namespace), the
  run's cgroup, its session and every process of its uid; it reaps the stub, and when it is itself a
  reaper (PID 1 of a container, or a child subreaper) it also reaps the namespace's init that the
  kernel reparents to it. No zombie is left, whatever the trainer's PID.

Why bubblewrap rather than our own namespace code: it is small, audited, and maintained for exactly
this job (Flatpak's sandbox), handles the ordering subtleties of user/mount/PID namespaces
(pivot_root, propagation, ``/proc`` and ``/dev`` set-up, a reaping PID 1, die-with-parent) that the
~880 lines of hand-written ``unshare``/``mount`` code used to get partly right (it left the host's
deeper world-writable directories writable and the whole host readable, and leaked its init as a
zombie). The stub keeps the four things bubblewrap does not do: cgroups, rlimits, the uid drop, and
the inode cap of the tmpfs.

Fallbacks (``sandbox_capabilities()["mode"]``, warned once, never silent):

* ``"bwrap"``: as above. ``make setup`` installs bubblewrap with apt when run as root.
* ``"namespaces"`` (root, bubblewrap missing or not working): the stub itself makes a private mount
  namespace, makes the *whole* host mount tree read-only (``mount_setattr(AT_RECURSIVE)``), mounts
  the capped tmpfs as working directory and ``/tmp`` / ``/var/tmp`` / ``/dev/shm``, and unshares the
  network and IPC namespaces. The host stays unwritable, but its world-readable files are readable,
  and there is no PID namespace (cleanup goes by uid).
* ``"process"`` (no root and no working bubblewrap, e.g. user namespaces disabled): rlimits, a new
  session, scrubbed environment and output caps only. The program can read and write what the
  trainer's user can (its working directory is a fresh private directory); cleanup goes by session,
  which a double fork plus ``setsid`` escapes. Install bubblewrap, or run as root.

Since issue #25: a **seccomp filter** (:mod:`grpo_variants.rewards.seccomp`, loaded by bubblewrap's
``--seccomp``; denied calls fail with EPERM; without bubblewrap or on an unknown architecture there is
none, warned once); per-run **CPU bandwidth** (``cpu_cores``, cgroup ``cpu.max`` / ``cpu.cfs_quota_us``);
uid slots owned through ``flock`` in one **machine-wide lock directory** (``_uid_lock_dir``); and the
stub no longer execs the next stage but forks it and stays as the run's **child subreaper**: whatever
the run leaves is reparented to it, killed once the run is over, and reaped (no zombie reaches a parent
of the trainer that adopts orphans without reaping them). ``SandboxPool.run_groups`` runs groups of
runs under one wall-clock budget each.

Residual risks: the kernel is the trust boundary (the calls the filter allows); without a cgroup the
memory total is enforced by polling and CPU is limited per process.
"""

from __future__ import annotations

import errno
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
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence



def _load_seccomp():
    # Inside the package: the sibling module. Loaded alone (stdlib only, as the reaper tests do): its file.
    if __package__:
        import importlib

        return importlib.import_module(__package__ + ".seccomp")
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py")
    spec = importlib.util.spec_from_file_location("_grpo_sandbox_seccomp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_seccomp_filter = _load_seccomp().build_filter

logger = logging.getLogger(__name__)

__all__ = [
    "Channel",
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

_INSIDE_WORKDIR = "/sandbox"  # the working directory's path inside bubblewrap
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_HOST_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # hidden behind the run's tmpfs ("namespaces" mode)
_LAUNCHER_EXIT = 125  # the stub failed to set the sandbox up (never the program's own code)
_LAUNCHER_TAG = "[grpo-sandbox]"
_GROUP_WEIGHT = 4 * min(8, os.cpu_count() or 1)  # 4 x the default pool size: runs are not starved by the host


@dataclass
class SandboxResult:
    """What one sandboxed run did.

    ``returncode`` is the program's exit status (negative: killed by that signal; None: never
    started). ``killed_reason`` is None for a normal exit, else one of ``"timeout"`` (wall clock),
    ``"cpu_time"``, ``"memory"``, ``"output_limit"``, ``"sandbox_error"``, ``"signal:SIGNAME"``.
    ``peak_memory_mb`` is the run's peak total memory when a cgroup measured it, else None.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration: float
    output_truncated: bool = False
    peak_memory_mb: float | None = None

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 on its own."""
        return self.returncode == 0 and not self.timed_out and self.killed_reason is None


class Channel:
    """The live stdin/stdout of one run (``run_in_sandbox(code, channel=...)`` in another thread): whole
    lines out of the run, bytes into it, every wait bounded by a deadline. :meth:`stop` ends the run (its
    ``killed_reason`` is then the reason given); :meth:`finish` closes its stdin and ends it after
    ``grace`` seconds unless it exits first. The run's unread output is capped by ``max_output_bytes``."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._wlock = threading.Lock()
        self._buf = bytearray()
        self._fd: int | None = None
        self.closed = False  # the run's stdout ended (or the run is over)
        self.reason: str | None = None
        self.stop_at: float | None = None
        self.first_line_at: float | None = None  # when the run's first whole line arrived

    def _attach(self, fd: int) -> None:
        os.set_blocking(fd, False)
        with self._cv:
            self._fd = fd
            self._cv.notify_all()
        if self.stop_at is not None:
            self._close_stdin()

    def _feed(self, data: bytes, cap: int) -> bool:
        with self._cv:
            if self.first_line_at is None and b"\n" in data:
                self.first_line_at = time.monotonic()
            self._buf += data
            self._cv.notify_all()
            return len(self._buf) <= cap

    def _eof(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
        self._close_stdin()

    def _close_stdin(self) -> None:
        with self._wlock:
            if self._fd is not None and self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def readline(self, deadline: float) -> bytes | None:
        """The next line (without its newline), or None at the deadline or the end of the run's output."""
        with self._cv:
            while True:
                i = self._buf.find(b"\n")
                if i >= 0:
                    line = bytes(self._buf[:i])
                    del self._buf[:i + 1]
                    return line
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    def write(self, data: bytes, deadline: float) -> bool:
        """Write all of ``data`` to the run's stdin by ``deadline``; False if it could not."""
        import select

        view = memoryview(data)
        with self._wlock:
            while view:
                if self._fd is None:
                    with self._cv:
                        if self._fd is None and not self.closed:
                            self._cv.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                if self._fd is None or self._fd < 0 or self.closed or time.monotonic() >= deadline:
                    return False
                if not select.select([], [self._fd], [], min(0.05, max(0.0, deadline - time.monotonic())))[1]:
                    continue
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:
                    continue
                except OSError:
                    return False
        return True

    def stop(self, reason: str) -> None:
        with self._cv:
            self.reason = self.reason or reason
            self.stop_at = time.monotonic()
            self._cv.notify_all()
        self._close_stdin()

    def finish(self, grace: float = 0.2) -> None:
        self._close_stdin()
        with self._cv:
            self.stop_at = time.monotonic() + grace if self.stop_at is None else self.stop_at


# --------------------------------------------------------------------------------------------
# The stub: runs as the trainer's user in a fresh ``python -I -S``, does what bubblewrap cannot
# (cgroup, rlimits, inode-capped tmpfs, uid drop) and execs the next stage.
# --------------------------------------------------------------------------------------------
_STUB = r"""
import os, sys, json, ctypes, resource, signal
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
def die(stage, detail):
    os.write(2, ("[grpo-sandbox] %s failed: %s\n" % (stage, detail)).encode())
    os._exit(125)
def check(rc, stage):
    if rc != 0:
        die(stage, os.strerror(ctypes.get_errno()))
for path in cfg["cgroup_procs"]:
    try:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except OSError as e:
        die("joining cgroup " + path, e)
wd, uid = cfg["workdir"], cfg["uid"]
if cfg["mount"]:
    fd = os.open(os.path.join(wd, "main.py"), os.O_RDONLY | os.O_NOFOLLOW)
    script = b""
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        script += chunk
    os.close(fd)
    check(libc.unshare(0x00020000 | cfg["unshare_extra"]), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    if cfg["ro_host"]:
        # struct mount_attr {attr_set = RDONLY|NOSUID, attr_clr, propagation, userns_fd} (devices stay
        # usable: /dev/null; the uid's permissions keep it from the others)
        attr = (ctypes.c_uint64 * 4)(1 | 2, 0, 0, 0)
        check(libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)),
              "mount_setattr(read-only, recursive)")
    opts = "size=%dm,nr_inodes=%d,mode=0700" % (cfg["workdir_mb"], cfg["max_files"])
    if uid is not None:
        opts += ",uid=%d,gid=%d" % (uid, uid)
    check(libc.mount(b"tmpfs", wd.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()), "tmpfs on the workdir")
    for name, data, mode in (("main.py", script, 0o600), ("tmp", None, 0o1777)):
        p = os.path.join(wd, name)
        if data is None:
            os.mkdir(p, mode)
            os.chmod(p, mode)
        else:
            with open(p, "wb") as f:
                f.write(data)
        if uid is not None:
            os.chown(p, uid, uid)
    if cfg["bind_tmp"]:
        # The whole tmpfs becomes /tmp (and /var/tmp, /dev/shm): the workdir may lie under /tmp, so bind
        # it through a descriptor opened before its path is shadowed.
        src = ("/proc/self/fd/%d" % os.open(wd, os.O_PATH | os.O_DIRECTORY)).encode()
        for d in cfg["bind_tmp"]:
            check(libc.mount(src, d.encode(), None, MS_BIND, None), "bind on " + d)
for name, soft, hard in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        die("privilege drop", "setuid(0) still works")
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # a credential change clears PDEATHSIG
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.umask(0o077)
os.chdir(cfg["cwd"])
# Stay as the run's reaper: whatever the next stage leaves (bubblewrap's namespace init outlives the outer
# bubblewrap by a moment) is reparented here and reaped, not to a parent of the trainer that may never reap.
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
child = os.fork()
if child == 0:
    try:
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as e:
        die("exec " + cfg["argv"][0], e)
code = 125
done = False
while True:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG if done else 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        done = True
    if done and pid == 0:
        # The run is over: what it left here (bubblewrap's init, a daemon without a PID namespace) ends too.
        import time
        try:
            for tid in os.listdir("/proc/self/task"):
                with open("/proc/self/task/%s/children" % tid) as f:
                    for p in f.read().split():
                        try:
                            os.kill(int(p), 9)
                        except OSError:
                            pass
        except OSError:
            pass
        time.sleep(0.002)
if code < 0:  # the next stage died of a signal: die of the same one, so the trainer sees it
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    code = 128 - code
os._exit(code)
"""


# --------------------------------------------------------------------------------------------
# Capabilities, base directory, uid slots
# --------------------------------------------------------------------------------------------
_caps_lock = threading.Lock()
_caps: dict | None = None
_base_dir: Path | None = None


def _is_root() -> bool:
    return os.geteuid() == 0


def _sandbox_base() -> Path:
    """A trainer-owned (mode 0711) directory holding run directories and uid lock files."""
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


def _bwrap_binary() -> str | None:
    """bubblewrap, unless ``GRPO_SANDBOX_BWRAP=0``; ``GRPO_SANDBOX_BWRAP=/path`` picks a binary."""
    env = os.environ.get("GRPO_SANDBOX_BWRAP", "")
    if env in ("0", "no", "off", "false"):
        return None
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


def sandbox_capabilities() -> dict:
    """What containment works here (probed once per process with real trial runs; warnings logged once).

    Keys: ``mode`` (``"bwrap"``, ``"namespaces"`` or ``"process"``, see the module docstring),
    ``bwrap`` (its path or None), ``uid_drop`` (a dedicated uid per run), ``ro_host`` (the host is
    read-only for the program), ``host_hidden`` (the host's files are not visible), ``netns``,
    ``pidns``, ``ipcns``, ``mountns``, ``inode_cap`` (bools), ``cgroup`` (``"v2"``, ``"v1"`` or None),
    ``python`` (the interpreter that runs the programs), ``uids``, ``is_root``, ``warnings``.
    """
    global _caps
    with _caps_lock:
        if _caps is not None:
            return _caps
        root = _is_root()
        uids = _uid_range() if root else []
        bwrap = _bwrap_binary()
        cg = _Cgroups.detect()
        base = {"uid_drop": bool(uids), "uids": uids, "cgroup": cg.version if cg else None, "bwrap": bwrap,
                "is_root": root, "python": None, "cpu_limit": bool(cg is not None and cg.has_cpu)}
        modes = (["bwrap"] if bwrap else []) + (["namespaces"] if root else []) + ["process"]
        chosen = None
        seccomp_ok = build_seccomp_filter() is not None and os.environ.get("GRPO_SANDBOX_SECCOMP", "") not in (
            "0", "no", "off", "false")
        for mode in modes:
            for py in _python_candidates():
                for filt in ([True, False] if mode == "bwrap" and seccomp_ok else [False]):
                    caps = dict(base, mode=mode, python=py, seccomp=filt, **_mode_flags(mode, root))
                    caps["uid_drop"] = caps["uid_drop"] and bool(uids)
                    if not caps["uid_drop"]:
                        caps["uids"] = []
                    res = _trial(caps, cg)
                    if res is not None and res.ok and res.stdout.strip() == "sandbox-ok":
                        chosen = caps
                        break
                    logger.debug("sandbox trial mode=%s python=%s seccomp=%s failed: %s", mode, py, filt, res)
                if chosen:
                    break
            if chosen:
                break
        if chosen is None:
            chosen = dict(base, mode="process", python=None, seccomp=False, **_mode_flags("process", root))
        chosen["_cgroups"] = cg
        if cg is not None:
            import atexit

            atexit.register(cg.cleanup)
        warnings = []
        if chosen["mode"] != "bwrap":
            why = "not installed" if not bwrap else "installed but not working here (user namespaces disabled?)"
            warnings.append(
                f"bubblewrap {why}: sandbox mode '{chosen['mode']}' — "
                + ("the host is read-only for programs but its world-readable files are readable, and there is "
                   "no PID namespace" if chosen["mode"] == "namespaces" else
                   "programs can read and write what this user can, and open network connections")
                + "; install it (`apt-get install -y bubblewrap`, done by `make setup` as root)"
            )
        if not chosen["seccomp"]:
            warnings.append(
                "no seccomp filter ("
                + ("needs bubblewrap" if chosen["mode"] != "bwrap" else
                   "disabled by GRPO_SANDBOX_SECCOMP=0" if os.environ.get("GRPO_SANDBOX_SECCOMP", "") in
                   ("0", "no", "off", "false") else
                   "unknown architecture " + os.uname().machine if build_seccomp_filter() is None else
                   "bubblewrap refused it")
                + "): io_uring, userfaultfd, keyrings, bpf, perf, ptrace and every socket family are reachable"
            )
        if not chosen["uid_drop"]:
            warnings.append(
                "no dedicated sandbox uid (not root): RLIMIT_NPROC counts all of this user's processes"
                + (" and stray-process cleanup relies on the session id" if not chosen["pidns"] else "")
            )
        if cg is None:
            warnings.append(
                "no usable cgroup (v2 with memory+pids, or v1): a run's total memory is enforced by polling "
                "(every 50 ms) and its process count by RLIMIT_NPROC only"
            )
        if cg is not None and not chosen["cpu_limit"]:
            warnings.append("the cgroup has no cpu controller for us: a run's CPU is limited per process "
                            "(RLIMIT_CPU) only, so a run that forks spinners slows the runs beside it")
        if not chosen["inode_cap"] and chosen["mode"] != "process":
            warnings.append("tmpfs without an inode cap (needs root); only its size is capped")
        if chosen["python"] is None:
            warnings.append(f"no interpreter runnable in the sandbox among {_python_candidates()}; runs will fail")
        for w in warnings:
            logger.warning("grpo-variants sandbox: %s", w)
        chosen["warnings"] = warnings
        _caps = chosen
        return chosen


def _mode_flags(mode: str, root: bool) -> dict:
    ns = mode in ("bwrap", "namespaces")
    return {
        "mountns": ns,
        "netns": ns,
        "ipcns": ns,
        "pidns": mode == "bwrap",
        "ro_host": ns,
        "host_hidden": mode == "bwrap",
        "inode_cap": ns and root,
        "uid_drop": root,
    }


def _trial(caps: dict, cg) -> SandboxResult | None:
    try:
        return _run(caps, cg, "print('sandbox-ok')", timeout=20.0, cpu_time=10, memory_mb=512, total_memory_mb=None,
                    max_processes=32, max_output_bytes=4096, stdin=None, max_file_mb=1, workdir_mb=4, max_files=64,
                    max_open_files=64, network=False, python=None, env=None, ro_paths=())
    except Exception as exc:  # pragma: no cover - a broken platform
        logger.debug("sandbox trial %s failed: %r", caps.get("mode"), exc)
        return None


def _uid_lock_dir() -> Path:
    """The machine-wide directory of the uid slots' lock files: the same for every trainer on this machine
    whatever its ``GRPO_SANDBOX_DIR``, so that an ``flock`` on ``uid-N.lock`` is the one proof of owning
    uid N (``GRPO_SANDBOX_LOCK_DIR`` overrides it; trainers sharing uids must share it)."""
    env = os.environ.get("GRPO_SANDBOX_LOCK_DIR")
    cands = [Path(env)] if env else [Path("/run/grpo-variants-sandbox-uids"), Path("/tmp/grpo-variants-sandbox-uids")]
    for d in cands:
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            st = d.lstat()
            if st.st_uid == os.getuid() and not d.is_symlink() and d.is_dir() and not st.st_mode & 0o022:
                return d
        except OSError:
            continue
    raise RuntimeError(f"No private directory for the sandbox uid locks among {[str(c) for c in cands]}; "
                       "set GRPO_SANDBOX_LOCK_DIR to one owned by this user and not writable by others.")


class _UidSlot:
    """An flock-held dedicated uid: no other run (in any process, of any trainer on this machine) uses it
    while held; the processes of that uid are the holder's, and only the holder kills them."""

    _next = 0
    _next_lock = threading.Lock()

    def __init__(self, uids: list[int]):
        self.uid: int | None = None
        self._fd: int | None = None
        if not uids:
            return
        locks = _uid_lock_dir()
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
                # A previous holder that did not finish (crashed) may have left processes behind: they
                # are ours. (The lock file says "busy" from acquisition to a clean release.)
                if os.pread(fd, 4, 0) != b"idle":
                    _kill_matching(uid=uid, sid=None)
                os.pwrite(fd, b"busy", 0)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"All {len(uids)} sandbox uids stay busy; raise GRPO_SANDBOX_UID_SLOTS.")
            time.sleep(0.01)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.pwrite(self._fd, b"idle", 0)
            except OSError:
                pass
            os.close(self._fd)  # releases the flock
            self._fd = None


# --------------------------------------------------------------------------------------------
# cgroups: one per run, holding every process of the run from its start
# --------------------------------------------------------------------------------------------
def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class _Cgroups:
    """The parent directories under which per-run cgroups are made (v2: one; v1: memory and pids)."""

    def __init__(self, version: str, parents: dict[str, str]):
        self.version = version
        self.parents = parents  # v2: {"unified": dir}; v1: {"memory": dir, "pids": dir}

    @staticmethod
    def detect() -> "_Cgroups | None":
        if os.environ.get("GRPO_SANDBOX_CGROUP", "") in ("0", "no", "off", "false"):
            return None
        mounts: dict[str, list[tuple[str, str]]] = {}  # controller -> [(root in hierarchy, mount point)]
        own: dict[str, str] = {}
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    left, _, right = line.partition(" - ")
                    fields, rfields = left.split(), right.split()
                    if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                        keys = ["unified"] if rfields[0] == "cgroup2" else rfields[2].split(",")
                        for key in keys:
                            mounts.setdefault(key, []).append((fields[3], fields[4]))
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, ctrls, path = line.rstrip("\n").split(":", 2)
                    for c in (ctrls.split(",") if ctrls else ["unified"]):
                        own[c] = path
        except (OSError, ValueError):
            return None

        def own_dir(ctrl: str, root: str, mnt: str) -> str:
            path = own.get(ctrl, "/")
            if root != "/" and (path == root or path.startswith(root + "/")):
                path = path[len(root):] or "/"
            d = os.path.join(mnt, path.lstrip("/"))
            return d if os.path.isdir(d) else mnt

        name = f"grpo_variants_sandbox_{os.getpid()}"
        # v2: a parent cgroup whose children get memory+pids: ours, or an ancestor (a cgroup that holds
        # processes cannot hand controllers to children, so our own one is usually not it).
        for root, mnt in mounts.get("unified", []):
            d = own_dir("unified", root, mnt)
            chain = [d]
            while d != mnt and d.startswith(mnt):
                d = os.path.dirname(d)
                chain.append(d)
            for d in chain:
                available = set(_read(os.path.join(d, "cgroup.controllers")).split())
                if not {"memory", "pids"} <= available:
                    continue
                parent = os.path.join(d, name)
                for want in (["+memory +pids +cpu"] if "cpu" in available else []) + ["+memory +pids"]:
                    try:
                        if not set(want.replace("+", "").split()) <= set(
                                _read(os.path.join(d, "cgroup.subtree_control")).split()):
                            _write(os.path.join(d, "cgroup.subtree_control"), want)
                        _clean_stale(d)
                        if not os.path.isdir(parent):
                            os.mkdir(parent)
                        _write(os.path.join(parent, "cgroup.subtree_control"), want)
                        break
                    except OSError:
                        continue
                else:
                    continue
                if "cpu" in want:
                    try:
                        _write(os.path.join(parent, "cpu.weight"), str(min(10000, 100 * _GROUP_WEIGHT)))
                    except OSError:
                        pass
                cg = _Cgroups("v2", {"unified": parent})
                if cg._selftest():
                    return cg
                _rmdir(parent)
        # v1: the memory and pids hierarchies (kept by many container hosts).
        parents = {}
        for ctrl in ("memory", "pids", "cpu"):
            for root, mnt in mounts.get(ctrl, []):
                d = own_dir(ctrl, root, mnt)
                try:
                    _clean_stale(d)
                    parent = os.path.join(d, name)
                    if not os.path.isdir(parent):
                        os.mkdir(parent)
                except OSError:
                    continue
                if ctrl == "cpu":
                    # The trainer's runs compete as one group with the host's processes: weigh the group
                    # like the runs a pool keeps going (each a default-weight process), not like one.
                    try:
                        _write(os.path.join(parent, "cpu.shares"), str(1024 * _GROUP_WEIGHT))
                    except OSError:
                        pass
                parents[ctrl] = parent
                break
        if "memory" in parents and "pids" in parents:
            cg = _Cgroups("v1", parents)
            if cg._selftest():
                return cg
        for p in parents.values():
            _rmdir(p)
        return None

    def cleanup(self) -> None:
        for p in self.parents.values():
            _clean_stale(os.path.dirname(p), only_pid=os.getpid())

    def _selftest(self) -> bool:
        try:
            run = self.create(64 << 20, 8)
        except OSError:
            return False
        run.remove()
        return True

    @property
    def has_cpu(self) -> bool:
        if self.version == "v1":
            return "cpu" in self.parents
        return "cpu" in _read(os.path.join(self.parents["unified"], "cgroup.subtree_control")).split()

    def create(self, memory_bytes: int, max_processes: int | None, cpu_cores: float | None = None) -> "_RunCgroup":
        """A run's cgroup; ``max_processes=None`` (v1): no pids cgroup, RLIMIT_NPROC of a dedicated uid binds.
        ``cpu_cores``: the run's CPU bandwidth (quota per period), when the cpu controller is ours."""
        tag = "run_" + uuid.uuid4().hex[:12]
        dirs = []
        parents = [p for c, p in self.parents.items() if (c != "pids" or max_processes is not None)
                   and (c != "cpu" or cpu_cores)]
        try:
            for parent in parents:
                d = os.path.join(parent, tag)
                os.mkdir(d)
                dirs.append(d)
            if self.version == "v2":
                d = dirs[0]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_processes if max_processes is not None else "max"))
                if cpu_cores and os.path.exists(os.path.join(d, "cpu.max")):
                    _write(os.path.join(d, "cpu.max"), "%d 100000" % max(1000, int(cpu_cores * 100000)))
            else:
                mem = dirs[0]
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                if max_processes is not None:
                    _write(os.path.join(dirs[1], "pids.max"), str(max_processes))
                if cpu_cores and "cpu" in self.parents:
                    cpu = dirs[-1]
                    _write(os.path.join(cpu, "cpu.cfs_period_us"), "100000")
                    _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(max(1000, int(cpu_cores * 100000))))
        except OSError:
            for d in dirs:
                _rmdir(d)
            raise
        return _RunCgroup(self.version, dirs)


def _clean_stale(d: str, only_pid: int | None = None) -> None:
    """Remove (empty) sandbox cgroups left by trainers that are gone (or, with ``only_pid``, by us)."""
    try:
        entries = os.listdir(d)
    except OSError:
        return
    for e in entries:
        if not e.startswith("grpo_variants_sandbox_"):
            continue
        try:
            pid = int(e.rsplit("_", 1)[1])
        except ValueError:
            continue
        if only_pid is not None and pid != only_pid:
            continue
        if only_pid is None and (pid == os.getpid() or os.path.exists(f"/proc/{pid}")):
            continue
        p = os.path.join(d, e)
        try:
            for run in os.listdir(p):
                if run.startswith("run_"):
                    _rmdir(os.path.join(p, run))
        except OSError:
            pass
        _rmdir(p)


def _rmdir(d: str) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass


class _RunCgroup:
    def __init__(self, version: str, dirs: list[str]):
        self.version, self.dirs = version, dirs

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        out = set()
        for f in self.procs_files:
            out.update(int(x) for x in _read(f).split() if x.isdigit())
        return sorted(out)

    def kill(self, wait_s: float = 2.0, spare: int | None = None) -> None:
        """SIGKILL every process of the cgroup (but ``spare``) and wait until they are gone."""
        if spare is None and self.version == "v2" and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        seen: set[int] = set()
        while True:
            pids = [p for p in self.pids() if p != spare and not _is_zombie(p)]
            seen.update(pids)
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            # A process leaves cgroup.procs a little before it is a zombie: wait for that too, so that
            # nothing of the run is still running when we return.
            if not pids and all(_is_zombie(p) for p in seen):
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)

    def oom_killed(self) -> bool:
        if self.version == "v2":
            for line in _read(os.path.join(self.dirs[0], "memory.events")).splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill" and v.strip() not in ("", "0"):
                    return True
            return False
        control = _read(os.path.join(self.dirs[0], "memory.oom_control"))
        for line in control.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return v.strip() not in ("", "0")
        # Kernels before 4.13 do not count OOM kills: hitting the limit is the best sign there is.
        return _read(os.path.join(self.dirs[0], "memory.failcnt")).strip() not in ("", "0")

    def peak_mb(self) -> float | None:
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        v = _read(os.path.join(self.dirs[0], name)).strip()
        return round(int(v) / (1 << 20), 1) if v.isdigit() else None

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.002)


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


def _kill_matching(uid: int | None, sid: int | None, wait_s: float = 2.0, spare: int | None = None) -> int:
    """SIGKILL every process with real uid ``uid`` or session ``sid`` (but ``spare``); wait until they are gone."""
    if uid is None and sid is None:
        return 0
    killed = 0
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for p in _matching_pids(uid, sid) if p != spare and not _is_zombie(p)]
        if not pids:
            return killed
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            logger.warning("grpo-variants sandbox: processes %s survived SIGKILL for %.1fs", pids, wait_s)
            return killed
        time.sleep(0.005)


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _is_zombie(pid: int) -> bool:
    f = _stat_fields(pid)
    return f is None or f[0] in (b"Z", b"X")


def _ppid(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[1]) if f else None


def _is_reaper() -> bool:
    """Are orphans reparented to this process (PID 1 of a namespace, or a child subreaper)?"""
    if os.getpid() == 1:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        if libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0:  # PR_GET_CHILD_SUBREAPER
            return bool(flag.value)
    except (OSError, AttributeError):  # pragma: no cover
        pass
    return False


def _tree_rss_mb(root: int) -> float:
    """Resident memory (MB) of ``root`` and its descendants (/proc/<pid>/task/*/children)."""
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    stack.extend(int(x) for x in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


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
    total_memory_mb: int | None = None,
    max_processes: int = 32,
    max_output_bytes: int = 64_000,
    stdin: str | bytes | None = None,
    max_file_mb: int = 16,
    workdir_mb: int = 64,
    max_files: int = 4096,
    max_open_files: int = 256,
    network: bool = False,
    python: str | None = None,
    env: dict[str, str] | None = None,
    ro_paths: Sequence[str] = (),
    cpu_cores: float | None = 1.0,
    channel: "Channel | None" = None,
) -> SandboxResult:
    """Run ``code`` (a Python program) in the sandbox; never raises for anything the program does.

    ``timeout`` is wall-clock seconds, after which every process of the run is killed. ``cpu_time``
    is RLIMIT_CPU seconds per process, ``memory_mb`` RLIMIT_AS per process, ``total_memory_mb``
    (default ``memory_mb``) the run's total memory (cgroup, else polled), ``max_processes`` the
    run's process/thread count (cgroup ``pids.max`` and RLIMIT_NPROC), ``max_output_bytes`` the cap
    on each of stdout and stderr (the run is killed when exceeded), ``max_file_mb`` RLIMIT_FSIZE,
    ``workdir_mb`` / ``max_files`` the size and inode cap of the writable tmpfs. ``network=True``
    keeps the host network. ``env`` adds variables to :data:`SANDBOX_ENV`. ``ro_paths`` are host
    paths made visible read-only (e.g. a site-packages directory the programs may import from).
    ``cpu_cores`` is the run's CPU bandwidth, all its processes together (cgroup ``cpu.max`` /
    ``cpu.cfs_quota_us``, where the cpu controller is usable; None: unlimited), so a run that forks
    spinners cannot starve the runs beside it. ``channel`` (a :class:`Channel`, instead of ``stdin``): the
    run's stdin and stdout are live, line by line, for a caller in another thread (the result's stdout is
    then empty); the run ends at EOF, at ``timeout``, or when the caller stops the channel.
    """
    caps = sandbox_capabilities()
    return _run(caps, caps.get("_cgroups"), code, timeout=timeout, cpu_time=cpu_time, memory_mb=memory_mb,
                total_memory_mb=total_memory_mb, max_processes=max_processes, max_output_bytes=max_output_bytes,
                stdin=stdin, max_file_mb=max_file_mb, workdir_mb=workdir_mb, max_files=max_files,
                max_open_files=max_open_files, network=network, python=python, env=env, ro_paths=ro_paths,
                cpu_cores=cpu_cores, channel=channel)


def _bwrap_argv(caps: dict, workdir: Path, python: str, network: bool, ro_paths: Sequence[str],
                workdir_mb: int, info_fd: int, seccomp_fd: int | None = None) -> list[str]:
    a = [caps["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
         "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", "--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    if network:
        a.append("--share-net")
    bound: list[str] = []
    for p in _SYSTEM_PATHS:
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
            bound.append(p)
    for f in _SYSTEM_FILES:
        a += ["--ro-bind-try", f, f]
    extra = [os.path.dirname(os.path.dirname(os.path.realpath(python)))] + [os.path.realpath(p) for p in ro_paths]
    for p in extra:
        if p and p != "/" and not any(p == b or p.startswith(b + "/") for b in bound) and os.path.exists(p):
            a += ["--ro-bind", p, p]
            bound.append(p)
    a += ["--proc", "/proc", "--dev", "/dev"]
    w = _INSIDE_WORKDIR
    if caps["inode_cap"]:  # the stub mounted the capped tmpfs on the workdir (root)
        a += ["--bind", str(workdir), w, "--bind", str(workdir / "tmp"), "/tmp",
              "--bind", str(workdir / "tmp"), "/dev/shm"]
    else:
        size = str(int(workdir_mb) << 20)
        a += ["--size", size, "--tmpfs", w, "--ro-bind", str(workdir / "main.py"), w + "/main.py",
              "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm"]
    a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", w, "--",
          os.path.realpath(python), "-I", "-B", "-X", "utf8", "main.py"]
    return a


def _run(caps: dict, cg, code: str, *, timeout, cpu_time, memory_mb, total_memory_mb, max_processes,
         max_output_bytes, stdin, max_file_mb, workdir_mb, max_files, max_open_files, network, python, env,
         ro_paths, cpu_cores=1.0, channel=None) -> SandboxResult:
    start = time.monotonic()
    py = python or caps["python"]
    if py is None:
        return SandboxResult(None, "", "no Python interpreter usable by the sandbox", False, "sandbox_error", 0.0)
    mode = caps["mode"]
    slot = _UidSlot(caps["uids"]) if caps["uid_drop"] else _UidSlot([])
    workdir = Path(tempfile.mkdtemp(prefix="run_", dir=_sandbox_base()))
    total_mb = int(total_memory_mb or memory_mb)
    run_cg: _RunCgroup | None = None
    proc: subprocess.Popen | None = None
    info_r = info_w = seccomp_fd = None
    init_pidfd = None
    cleaned = False
    try:
        main = workdir / "main.py"
        main.write_text(code, encoding="utf-8", errors="surrogatepass")
        if slot.uid is not None and not caps["inode_cap"]:
            # The program (or bwrap, as the run's uid) reads/works in this directory directly.
            os.chown(workdir, slot.uid, slot.uid)
            os.chown(main, slot.uid, slot.uid)
        if mode == "process" or (mode == "namespaces" and not caps["inode_cap"]):
            (workdir / "tmp").mkdir(mode=0o700)
            if slot.uid is not None:
                os.chown(workdir / "tmp", slot.uid, slot.uid)
        os.chmod(workdir, 0o700)
        cpu = max(1, int(cpu_time))
        nofile = max(16, int(max_open_files))
        rlimits = [
            ("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_AS", int(memory_mb) << 20, int(memory_mb) << 20),
            ("RLIMIT_FSIZE", int(max_file_mb) << 20, int(max_file_mb) << 20),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NOFILE", nofile, nofile),
        ]
        if slot.uid is not None or not _is_root():
            rlimits.append(("RLIMIT_NPROC", int(max_processes), int(max_processes)))
        if cg is not None:
            try:
                # + 3: the stub (the run's reaper), bwrap and bwrap's init. With a dedicated uid, RLIMIT_NPROC already
                # bounds exactly this run's processes, and v1 saves joining a second hierarchy.
                pids = None if (cg.version == "v1" and slot.uid is not None) else int(max_processes) + 3
                run_cg = cg.create(total_mb << 20, pids, cpu_cores)
            except OSError as exc:
                logger.warning("grpo-variants sandbox: could not create the run's cgroup (%s); polling memory", exc)
        inside = mode == "bwrap"
        bind_tmp = [d for d in _HOST_TMP_DIRS if os.path.isdir(d) and not os.path.islink(d)] \
            if mode == "namespaces" and caps["inode_cap"] else []
        cwd = _INSIDE_WORKDIR if inside else ("/tmp" if bind_tmp else str(workdir))
        prog_env = dict(SANDBOX_ENV)
        prog_env.update(env or {})
        prog_env.update(HOME=cwd, TMPDIR="/tmp" if inside or bind_tmp else str(workdir / "tmp"))
        pass_fds: tuple[int, ...] = ()
        if inside:
            info_r, info_w = os.pipe()
            pass_fds = (info_w,)
            bpf = build_seccomp_filter(network=bool(network)) if caps.get("seccomp") else None
            if bpf is not None:
                # bwrap reads the filter from this pipe (it fits the pipe's buffer) and loads it before exec.
                seccomp_fd, w = os.pipe()
                try:
                    os.write(w, bpf)
                finally:
                    os.close(w)
                pass_fds = (info_w, seccomp_fd)
            argv = _bwrap_argv(caps, workdir, py, network, ro_paths, workdir_mb, info_w, seccomp_fd)
        else:
            argv = [py, "-I", "-B", "-X", "utf8", "main.py"]
        cfg = {
            "workdir": str(workdir),
            "cwd": "/" if inside else cwd,
            "uid": slot.uid,
            "mount": bool(caps["inode_cap"]),
            "ro_host": mode == "namespaces",
            "unshare_extra": (0x40000000 | 0x08000000) if mode == "namespaces" and not network else
                             (0x08000000 if mode == "namespaces" else 0),
            "bind_tmp": bind_tmp,
            "workdir_mb": int(workdir_mb),
            "max_files": max(16, int(max_files)),
            "rlimits": rlimits,
            "cgroup_procs": run_cg.procs_files if run_cg else [],
            "argv": argv,
            "env": prog_env,
        }
        stdin_r = None
        if channel is not None:
            stdin_r, stdin_w = os.pipe()
            channel._attach(stdin_w)
        elif stdin is not None:
            # A pipe, not a file: once read, the program cannot seek back and read it again.
            data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
            stdin_r, stdin_w = os.pipe()
            threading.Thread(target=_feed, args=(stdin_w, data), daemon=True, name="grpo-sandbox-stdin").start()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _STUB, json.dumps(cfg)],
                stdin=stdin_r if stdin_r is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(SANDBOX_ENV),
                cwd="/",
                close_fds=True,
                pass_fds=pass_fds,
                start_new_session=True,
            )
        finally:
            if stdin_r is not None:
                os.close(stdin_r)
            if info_w is not None:
                os.close(info_w)
                info_w = None
            if seccomp_fd is not None:
                os.close(seccomp_fd)
                seccomp_fd = None
        if info_r is not None:
            init_pidfd = _init_pidfd(info_r, proc.pid)
        poll_memory = None if run_cg is not None else total_mb
        stdout, stderr, timed_out, over, truncated, mem_over = _collect(
            proc, start + timeout, max_output_bytes, poll_memory, channel)
        if timed_out or over or mem_over or (channel is not None and channel.reason):
            _kill_run(proc.pid, init_pidfd, run_cg, slot.uid)
        # Wait for the stub/bwrap to exit *without reaping it*, so that its pid (our process group and
        # session id) cannot be reused while we kill what the program left behind.
        while not _exited_nowait(proc.pid):
            if time.monotonic() >= start + timeout:
                timed_out = True
                _kill_run(proc.pid, init_pidfd, run_cg, slot.uid)
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                break
            time.sleep(0.002)
        _kill_run(proc.pid, init_pidfd, run_cg, slot.uid)
        if run_cg is None or mode != "bwrap":
            # No cgroup (or no PID namespace): find what is left by uid and session. (A process cannot
            # leave its cgroup: bubblewrap's root has no /sys, and the cgroup namespace hides the rest.)
            _kill_matching(uid=slot.uid, sid=proc.pid)
        rc = proc.wait()
        _reap_orphan_init(init_pidfd)
        if mode != "bwrap" and slot.uid is not None:
            _reap_uid_orphans(slot.uid)
        cleaned = True
        out_s = stdout.decode("utf-8", errors="replace")
        err_s = stderr.decode("utf-8", errors="replace")
        if inside and rc is not None and 128 < rc < 160 and _LAUNCHER_TAG not in err_s:
            rc = -(rc - 128)  # bubblewrap reports a signal death as 128 + signal
        oom = run_cg.oom_killed() if run_cg else False
        reason = None
        if channel is not None and channel.reason is not None:
            reason = channel.reason
        elif timed_out:
            reason = "timeout"
        elif over:
            reason = "output_limit"
        elif mem_over or (oom and rc != 0):
            reason = "memory"
        elif rc == _LAUNCHER_EXIT and _LAUNCHER_TAG in err_s:
            reason = "sandbox_error"
            if caps is _caps:
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
            peak_memory_mb=run_cg.peak_mb() if run_cg else None,
        )
    finally:
        if channel is not None:
            channel._eof()
        if proc is not None:
            if proc.returncode is None:  # an exception above: make sure nothing survives
                _kill_run(proc.pid, init_pidfd, run_cg, slot.uid)
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for fd in (info_r, info_w, init_pidfd, seccomp_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if not cleaned:
            _kill_matching(uid=slot.uid, sid=None)
        if run_cg is not None:
            run_cg.kill()
            run_cg.remove()
        shutil.rmtree(workdir, ignore_errors=True)
        slot.release()


def _init_pidfd(info_r: int, outer_pid: int) -> int | None:
    """A pidfd on bubblewrap's PID 1 (from ``--info-fd``), verified to be the outer bwrap's child."""
    import select

    data = b""
    deadline = time.monotonic() + 2.0
    while b"}" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([info_r], [], [], left)[0]:
            break
        chunk = os.read(info_r, 4096)
        if not chunk:  # bwrap closed it (exited, or failed before starting the program)
            break
        data += chunk
    try:
        pid = int(json.loads(data.decode())["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    parent = _ppid(pid)
    if parent != outer_pid and (parent is None or _ppid(parent) != outer_pid):  # gone, pid reused: not ours
        os.close(fd)
        return None
    return fd


def _kill_run(outer_pid: int, init_pidfd: int | None, run_cg: _RunCgroup | None, uid: int | None = None) -> None:
    """Kill the namespace's init first (so that bwrap reaps it), then everything else of the run but the
    stub (``outer_pid``, the run's reaper: it reaps what dies and exits), then whatever is left."""
    if init_pidfd is not None:
        try:
            signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
            deadline = time.monotonic() + 0.5
            while not _exited_nowait(outer_pid) and time.monotonic() < deadline:
                time.sleep(0.001)
        except OSError:
            pass
    if not _exited_nowait(outer_pid):
        if run_cg is not None:
            run_cg.kill(wait_s=0.5, spare=outer_pid)
        else:
            _kill_matching(uid=uid, sid=outer_pid, wait_s=0.5, spare=outer_pid)
        deadline = time.monotonic() + 1.0
        while not _exited_nowait(outer_pid) and time.monotonic() < deadline:
            time.sleep(0.001)
    if run_cg is not None:
        run_cg.kill()
    _killpg(outer_pid)


def _reap_orphan_init(init_pidfd: int | None) -> None:
    """When we are a reaper, the namespace's init (bwrap's child) may have been reparented to us."""
    if init_pidfd is None or not _is_reaper():
        return
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            res = os.waitid(os.P_PIDFD, init_pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return  # not our child (bwrap reaped it, or another reaper has it)
        except (AttributeError, OSError):
            return
        if res is not None:
            return
        time.sleep(0.002)


def _reap_uid_orphans(uid: int) -> None:
    """Without a PID namespace, a run's double-forked daemon is reparented to a reaper: when that is
    us, reap the zombies of the run's (dedicated, so unambiguous) uid."""
    if not _is_reaper():
        return
    me = os.getpid()
    for pid in _matching_pids(uid, None):
        if _ppid(pid) == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


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


def _collect(proc: subprocess.Popen, deadline: float, cap: int,
             poll_memory_mb: int | None, channel: "Channel | None" = None) -> tuple[bytes, bytes, bool, bool, bool, bool]:
    """Read stdout/stderr up to ``cap`` bytes each until EOF, exit, deadline, overflow or (polling
    fallback) the run's resident memory exceeding ``poll_memory_mb``. With a ``channel``, stdout goes to it
    (``cap`` bounds what it holds unread) and the channel's stop ends the run."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = over = truncated = mem_over = False
    exited_at = None
    next_poll = time.monotonic() + 0.05
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if channel is not None and channel.stop_at is not None and now >= channel.stop_at:
                channel.reason = channel.reason or "finished"
                break
            if exited_at is None and _exited_nowait(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > 0.05:
                # The program exited but something (a background child) holds the pipes open.
                break
            if poll_memory_mb is not None and now >= next_poll:
                next_poll = now + 0.05
                if _tree_rss_mb(proc.pid) > poll_memory_mb:
                    mem_over = True
                    break
            wait = min(0.05, max(0.0, deadline - now))
            if channel is not None and channel.stop_at is not None:
                wait = max(0.0, min(wait, channel.stop_at - now))
            for key, _ in sel.select(timeout=wait):
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
                if channel is not None and fd == proc.stdout.fileno():
                    if not channel._feed(data, cap):
                        channel.reason = channel.reason or "output_limit"
                        over = True
                        break
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
    out, err = bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()])
    return out, err, timed_out, over, truncated, mem_over


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

    def map(self, fn, items: Sequence) -> list:
        """``[fn(item) for item in items]``, run in the pool's worker threads; results in input order."""
        items = list(items)
        if self.max_workers == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        return [f.result() for f in [self._pool().submit(fn, x) for x in items]]

    def run_groups(self, groups: Sequence[Sequence[tuple[str, str | bytes | None]]],
                   budget: float | Sequence[float] | None = None, **overrides) -> list[list[SandboxResult]]:
        """Run each group of ``(code, stdin)`` runs one after another in one worker, all of a group's runs
        within one wall-clock ``budget`` (default: the ``timeout`` option; a sequence gives one budget per
        group): each run gets what is left of it, and a run with nothing left is not started
        (``killed_reason="timeout"``, ``returncode=None``). Groups run in parallel; results come back in
        input order."""
        opts = {**self.run_options, **overrides}
        groups = [list(g) for g in groups]
        default = float(opts.get("timeout", 5.0))
        if budget is None or isinstance(budget, (int, float)):
            budgets = [float(budget if budget is not None else default)] * len(groups)
        else:
            budgets = [float(b) for b in budget]
            if len(budgets) != len(groups):
                raise ValueError(f"run_groups got {len(groups)} groups but {len(budgets)} budgets.")
        if not groups:
            return []
        sandbox_capabilities()

        def one(group, budget):
            deadline = time.monotonic() + budget
            out = []
            for code, stdin in group:
                left = deadline - time.monotonic()
                if left < 0.05:
                    out.append(SandboxResult(None, "", "wall-clock budget of the group spent", True, "timeout", 0.0))
                    continue
                out.append(run_in_sandbox(code, stdin=stdin, **{**opts, "timeout": min(float(opts.get("timeout", 5.0)),
                                                                                        left)}))
            return out

        if self.max_workers == 1 or len(groups) == 1:
            return [one(g, b) for g, b in zip(groups, budgets)]
        futs = [self._pool().submit(one, g, b) for g, b in zip(groups, budgets)]
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
