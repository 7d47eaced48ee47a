"""Kernel-enforced confinement for running model-written code (Linux, x86_64 or aarch64).

Three layers, each from the kernel and none needing privileges:
- Landlock (Linux >= 5.13): files can be written, created, removed or truncated only under
  one directory; on kernels with Landlock ABI >= 4 TCP bind/connect is refused too, and with
  ABI >= 6 signals to processes outside the sandbox. A child running model-written code adds a
  second layer: it reads only the directories it is given and writes only its own.
- seccomp: the process is killed (SIGSYS) when it creates a socket, a child process (fork,
  vfork, clone without CLONE_THREAD, posix_spawn), execs, signals a process other than itself,
  ptraces, mounts, changes file modes/owners/times, or uses io_uring, bpf or namespaces.
  Threads stay allowed (clone3 answers ENOSYS so glibc falls back to the checkable clone).
- rlimits: address space (memory), CPU seconds, file size, open files, no core dumps.
A process that runs as root also drops every capability first (uid 0 without capabilities
cannot bypass file permissions, limits or the layers above).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct

from megatron_rlvr.errors import UserError


class SandboxUnavailable(UserError):
    """This machine cannot confine model-written code (no Landlock, or an unsupported CPU)."""


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 22, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECCOMP_MODE_FILTER = 2


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (no orphans)."""
    import signal

    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ----------------------------------------------------------------------------- capabilities
def drop_capabilities() -> None:
    """Root keeps uid 0 (files stay readable, imports work) but loses every capability, for
    good: the bounding set is emptied and securebits stop execve from giving them back."""
    if os.geteuid() != 0:
        return
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    noroot, noroot_locked, no_fixup, no_fixup_locked, keep_locked = 1, 2, 4, 8, 32
    _prctl(PR_SET_SECUREBITS, noroot | noroot_locked | no_fixup | no_fixup_locked | keep_locked)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all empty
    _check(_libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)), "capset")


# ----------------------------------------------------------------------------- landlock
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_WRITE_V1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make *
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or disabled."""
    result = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(result), 0)


def confine_writes(directory: str) -> int:
    """From now on this process and its children write only under `directory` (and, on
    Landlock ABI >= 4, open no TCP connection). Returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise SandboxUnavailable(
            "the sandbox needs Linux Landlock (kernel >= 5.13 with landlock in its LSM "
            "list) to keep model-written code from writing outside its temporary directory"
        )
    write = FS_WRITE_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    write |= FS_IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", write, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(
        _libc.syscall(
            SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
        ),
        "landlock_create_ruleset",
    )
    parent = os.open(directory, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
    try:
        rule = struct.pack("=Qi", write, parent)  # struct landlock_path_beneath_attr (packed)
        _check(
            _libc.syscall(
                SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.c_char_p(rule), ctypes.c_uint32(0)
            ),
            "landlock_add_rule",
        )
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _check(
            _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)),
            "landlock_restrict_self",
        )
    finally:
        os.close(parent)
        os.close(ruleset)
    return abi


FS_READ_FILE, FS_READ_DIR = 1 << 2, 1 << 3
_FILE_RIGHTS = (1 << 0) | (1 << 1) | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # those a rule on a file may hold


def confine_child(own: str, readable: list[str]) -> None:
    """A further Landlock layer for a child: it reads only `readable` (directories or files) and
    its `own` directory, and writes only there, so no dataset file or other child's directory is
    in its reach."""
    abi = landlock_abi()
    write = FS_WRITE_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    write |= FS_IOCTL_DEV if abi >= 5 else 0
    handled = write | FS_READ_FILE | FS_READ_DIR
    attr = struct.pack("QQQ", handled, 0, 0)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(
        _libc.syscall(
            SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
        ),
        "landlock_create_ruleset",
    )
    try:
        for path, rights in [(p, FS_READ_FILE | FS_READ_DIR) for p in readable] + [(own, handled)]:
            if not os.path.isdir(path):
                rights = (rights | (1 << 1 if path == os.devnull else 0)) & _FILE_RIGHTS  # /dev/null takes writes
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", rights, fd)
                _check(
                    _libc.syscall(
                        SYS_LANDLOCK_ADD_RULE,
                        ctypes.c_int(ruleset),
                        ctypes.c_int(1),
                        ctypes.c_char_p(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule({path})",
                )
            finally:
                os.close(fd)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock")
    finally:
        os.close(ruleset)


# ----------------------------------------------------------------------------- seccomp
# Syscalls that kill the process, by architecture: x86_64 from arch/x86/entry/syscalls/
# syscall_64.tbl, aarch64 from include/uapi/asm-generic/unistd.h.
_DENIED_COMMON = {  # name: (x86_64, aarch64)
    "socket": (41, 198),
    "execve": (59, 221),
    "execveat": (322, 281),
    "ptrace": (101, 117),
    "setpgid": (109, 154),
    "setsid": (112, 157),
    "chroot": (161, 51),
    "acct": (163, 89),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "init_module": (175, 105),
    "delete_module": (176, 106),
    "finit_module": (313, 273),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "unshare": (272, 97),
    "setns": (308, 268),
    "tkill": (200, 130),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "pidfd_send_signal": (424, 424),
    "perf_event_open": (298, 241),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "fchmod": (91, 52),
    "fchmodat": (268, 53),
    "fchmodat2": (452, 452),
    "fchown": (93, 55),
    "fchownat": (260, 54),
    "setxattr": (188, 5),
    "lsetxattr": (189, 6),
    "fsetxattr": (190, 7),
    "removexattr": (197, 14),
    "lremovexattr": (198, 15),
    "fremovexattr": (199, 16),
    "utimensat": (280, 88),
}
_DENIED_X86_ONLY = {
    "fork": 57,
    "vfork": 58,
    "chmod": 90,
    "chown": 92,
    "lchown": 94,
    "utime": 132,
    "utimes": 235,
    "futimesat": 261,
}
_ARCH = {  # machine: (AUDIT_ARCH_*, index in _DENIED_COMMON, clone, clone3, kill, tgkill)
    "x86_64": (0xC000003E, 0, 56, 435, 62, 234),
    "aarch64": (0xC00000B7, 1, 220, 435, 129, 131),
}
CLONE_THREAD = 0x00010000
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
ENOSYS = 38


def _assemble(program: list[tuple]) -> bytes:
    """("label", name) | ("ld", offset) | ("jeq"/"jge"/"jset", k, if_true, if_false) | ("ret", value)
    → struct sock_filter[]; jump targets are labels (None: the next instruction)."""
    code = [op for op in program if op[0] != "label"]
    at, index = {}, 0
    for op in program:
        if op[0] == "label":
            at[op[1]] = index
        else:
            index += 1
    out = b""
    for i, op in enumerate(code):
        if op[0] == "ld":
            out += struct.pack("HBBI", 0x20, 0, 0, op[1])  # BPF_LD | BPF_W | BPF_ABS
        elif op[0] == "ret":
            out += struct.pack("HBBI", 0x06, 0, 0, op[1])  # BPF_RET | BPF_K
        else:
            jt, jf = (0 if target is None else at[target] - i - 1 for target in op[2:4])
            opcode = {"jeq": 0x15, "jge": 0x35, "jset": 0x45}[op[0]]
            out += struct.pack("HBBI", opcode, jt, jf, op[1])
    return out


def seccomp_program(machine: str, pid: int) -> bytes:
    """The filter for a process `pid` on `machine` (see the module docstring)."""
    if machine not in _ARCH:
        raise SandboxUnavailable(f"the sandbox's seccomp filter knows x86_64 and aarch64, not {machine}")
    arch, column, clone, clone3, kill, tgkill = _ARCH[machine]
    denied = sorted(
        {nrs[column] for nrs in _DENIED_COMMON.values()}
        | (set(_DENIED_X86_ONLY.values()) if machine == "x86_64" else set())
    )
    program: list[tuple] = [("ld", 4), ("jeq", arch, None, "kill"), ("ld", 0)]
    if machine == "x86_64":
        program.append(("jge", 0x40000000, "kill", None))  # the x32 ABI's numbering
    program += [("jeq", nr, "kill", None) for nr in denied]
    program += [
        ("jeq", clone, "clone", None),
        ("jeq", clone3, "enosys", None),
        ("jeq", kill, "self", None),
        ("jeq", tgkill, "self", None),
        ("ret", RET_ALLOW),
        ("label", "clone"),
        ("ld", 16),
        ("jset", CLONE_THREAD, "allow", "kill"),
        ("label", "self"),
        ("ld", 20),
        ("jeq", 0, None, "kill"),
        ("ld", 16),
        ("jeq", pid, "allow", "kill"),
        ("label", "allow"),
        ("ret", RET_ALLOW),
        ("label", "kill"),
        ("ret", RET_KILL_PROCESS),
        ("label", "enosys"),
        ("ret", RET_ERRNO | ENOSYS),
    ]
    return _assemble(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def install_seccomp() -> None:
    """Applies the filter to this (single-threaded) process and everything it starts."""
    program = seccomp_program(platform.machine(), os.getpid())
    fprog = _SockFprog(len(program) // 8, program)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


# ----------------------------------------------------------------------------- rlimits
def limit_resources(*, memory_mb: int, cpu_s: int, file_bytes: int, open_files: int = 64) -> None:
    for which, value in (
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_NOFILE, open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL a second later


def check_available() -> int:
    """Raises SandboxUnavailable when this machine cannot run the sandbox; returns the
    Landlock ABI."""
    seccomp_program(platform.machine(), 1)
    abi = landlock_abi()
    if abi < 1:
        raise SandboxUnavailable(
            "the sandbox needs Linux Landlock (kernel >= 5.13 with landlock in its LSM list) "
            "to keep model-written code from writing outside its temporary directory"
        )
    return abi
