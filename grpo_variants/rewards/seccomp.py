"""A seccomp filter for sandboxed programs, built as a classic-BPF program in pure Python.

bubblewrap loads it (``--seccomp FD``) after building the namespaces and before exec'ing the program;
no libseccomp or binding is needed. Modelled on Docker's default profile, it makes these calls fail
with ``EPERM`` (errno 1):

* sockets of any family but ``AF_UNIX`` (``socket`` / ``socketpair``; with ``network=True`` also
  ``AF_INET`` / ``AF_INET6``): no ``AF_VSOCK`` to the hypervisor, ``AF_NETLINK``, ``AF_PACKET`` ...;
* ``io_uring_setup`` / ``io_uring_enter`` / ``io_uring_register``, ``userfaultfd``, ``bpf``,
  ``perf_event_open``, ``ptrace``, ``process_vm_readv`` / ``process_vm_writev``, ``kcmp``,
  ``pidfd_getfd``, ``process_madvise``;
* the kernel keyring: ``keyctl``, ``add_key``, ``request_key``;
* mounts and namespaces: ``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``open_tree``,
  ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``, ``unshare``,
  ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag;
* system administration: ``kexec_load`` / ``kexec_file_load``, ``init_module`` / ``finit_module`` /
  ``delete_module``, ``reboot``, ``swapon`` / ``swapoff``, ``acct``, ``settimeofday`` /
  ``clock_settime`` / ``adjtimex`` / ``clock_adjtime``, ``sethostname`` / ``setdomainname``,
  ``syslog``, ``quotactl``, ``lookup_dcookie``, ``name_to_handle_at`` / ``open_by_handle_at``,
  ``fanotify_init``, ``vhangup``, and on x86_64 ``iopl``, ``ioperm``, ``uselib``, ``_sysctl``.

``clone3`` fails with ``ENOSYS`` (its flags are in memory a filter cannot read), so the C library falls
back to ``clone``, whose flags it can. A call made through another architecture's table (a 32-bit
``int 0x80`` on x86_64) kills the process; x32 calls fail with ``EPERM``. Everything else is allowed
(``memfd_create`` too: its pages are charged to the run's memory cgroup, as Docker allows it).
Architectures: x86_64 and aarch64; elsewhere :func:`build_filter` returns None and the sandbox runs
without a filter (announced once, see :func:`grpo_variants.rewards.sandbox.sandbox_capabilities`).
"""

from __future__ import annotations

import platform
import struct

__all__ = ["build_filter", "DENIED", "syscall_numbers", "supported_arch"]

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16
# classic BPF opcodes
_LD_W_ABS = 0x20     # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15        # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35        # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45       # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06        # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
X32_SYSCALL_BIT = 0x40000000

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# name: (x86_64, aarch64); None where the call does not exist on that architecture.
_TABLE = {
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "userfaultfd": (323, 282), "bpf": (321, 280), "perf_event_open": (298, 241), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "adjtimex": (159, 171), "clock_adjtime": (305, 266),
    "sethostname": (170, 161), "setdomainname": (171, 162), "syslog": (103, 116), "quotactl": (179, 60),
    "lookup_dcookie": (212, 18), "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "fanotify_init": (300, 262), "vhangup": (153, 58),
    "iopl": (172, None), "ioperm": (173, None), "uselib": (134, None), "_sysctl": (156, None),
}
DENIED = tuple(sorted(_TABLE))
_SPECIAL = {"socket": (41, 198), "socketpair": (53, 199), "clone": (56, 220), "clone3": (435, 435)}


def supported_arch(machine: str | None = None) -> str | None:
    m = (machine or platform.machine()).lower()
    m = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
    return m if m in _ARCH else None


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """Every call the filter handles -> its number on ``machine`` (default: this one)."""
    arch = supported_arch(machine)
    if arch is None:
        return {}
    col = 0 if arch == "x86_64" else 1
    return {name: nums[col] for name, nums in {**_TABLE, **_SPECIAL}.items() if nums[col] is not None}


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


def build_filter(*, network: bool = False, machine: str | None = None) -> bytes | None:
    """The filter as bytes (an array of ``struct sock_filter``, what ``bwrap --seccomp`` reads), or None
    on an architecture it does not know."""
    arch = supported_arch(machine)
    if arch is None:
        return None
    nums = syscall_numbers(arch)
    deny = sorted({nums[n] for n in DENIED if n in nums})
    eperm = RET_ERRNO | EPERM
    prog = [
        _ins(_LD_W_ABS, _OFF_ARCH),
        _ins(_JEQ_K, _ARCH[arch], 1, 0),
        _ins(_RET_K, RET_KILL_PROCESS),
        _ins(_LD_W_ABS, _OFF_NR),
    ]
    if arch == "x86_64":
        prog += [_ins(_JGE_K, X32_SYSCALL_BIT, 0, 1), _ins(_RET_K, eperm)]
    for nr in deny:
        prog += [_ins(_JEQ_K, nr, 0, 1), _ins(_RET_K, eperm)]
    prog += [_ins(_JEQ_K, nums["clone3"], 0, 1), _ins(_RET_K, RET_ERRNO | ENOSYS)]
    # clone: refuse new namespaces (flags are args[0] on both architectures; CLONE_NEW* are in the low word).
    prog += [_ins(_JEQ_K, nums["clone"], 0, 3), _ins(_LD_W_ABS, _OFF_ARG0),
             _ins(_JSET_K, CLONE_NEW_FLAGS, 0, 1), _ins(_RET_K, eperm)]
    families = [AF_UNIX] + ([AF_INET, AF_INET6] if network else [])
    # socket / socketpair: args[0] is the family (the accumulator may hold clone's flags: reload the number).
    body = [_ins(_LD_W_ABS, _OFF_NR)]
    n_fam = len(families)
    # if nr == socket or nr == socketpair: goto family check, else allow
    body += [_ins(_JEQ_K, nums["socket"], 2, 0), _ins(_JEQ_K, nums["socketpair"], 1, 0), _ins(_RET_K, RET_ALLOW)]
    body += [_ins(_LD_W_ABS, _OFF_ARG0)]
    for k, fam in enumerate(families):
        body += [_ins(_JEQ_K, fam, n_fam - k, 0)]
    body += [_ins(_RET_K, eperm), _ins(_RET_K, RET_ALLOW)]
    prog += body
    if len(prog) > 4096:  # pragma: no cover - BPF_MAXINSNS
        raise ValueError("seccomp filter too long")
    return b"".join(prog)
