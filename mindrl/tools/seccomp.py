"""The system calls the sandboxed code may not make, as a seccomp filter (a classic BPF program).

rlimits bound what a process maps and writes, not every way to hold the host's memory or slip past the watch on
the sandbox's CPU time, and a user namespace lets its owner mount a fresh, unbounded tmpfs. So the code may not:
- create anonymous files or System V IPC objects (`memfd_create` + `fallocate` and `shmget` held gigabytes outside
  RLIMIT_AS; message queues and semaphore sets hold kernel memory too): every file it writes is on a size- and
  inode-capped tmpfs;
- open a socket other than a Unix one (its network namespace has nothing to reach, and TCP buffers are kernel memory
  no limit of the sandbox counts), or raise a socket's buffer sizes;
- make namespaces or mounts (`unshare`, `setns`, `mount` and the new mount API, `clone`/`clone3` with a namespace
  flag): a nested user and mount namespace is where an unbounded tmpfs would come from;
- change what SIGCHLD or SIGXFSZ do: children reaped by the kernel itself (SIGCHLD ignored) would take their CPU
  time out of every count the watch reads, and a write past the file limit must end the writer, which an ignored
  SIGXFSZ would turn into an error the code can swallow (Python ignores it at start-up; refused, it stays at its
  default);
- reach kernel facilities a tool never needs and that pin memory or widen the attack surface (`userfaultfd`, `bpf`,
  `perf_event_open`, `io_uring_setup`, the key rings, `memfd_secret`).
Each is refused with EPERM, an ordinary error the code (and the model) reads, not a kill; `clone3` answers ENOSYS,
which makes the C library fall back to `clone`, whose flags the filter can read (clone3 passes them in memory). A
system call of another ABI (32-bit x86, x32) kills the process: the table below is the native one's.

The program is built here, on the host, and installed by the sandbox's launcher just before it starts the code, so
the launcher itself may still set up the mounts the filter forbids afterwards.
"""

from __future__ import annotations

import errno
import functools
import platform
import signal
import struct

from mindrl.config.errors import ConfigError

# BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_REFUSE, _ABSENT = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (each little endian)
_NR, _ARCH = 0, 4
#: x86-64's x32 ABI marks its calls with this bit
_X32_BIT = 0x40000000
#: clone flags that make a namespace
_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_AF_UNIX, _SOL_SOCKET, _SO_SNDBUF, _SO_RCVBUF = 1, 1, 7, 8

_REFUSED = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "unshare", "setns", "mount", "umount2",
            "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
            "userfaultfd", "bpf", "perf_event_open", "io_uring_setup", "keyctl", "add_key", "request_key")

#: machine → (AUDIT_ARCH, {name: number}) for the native ABI (asm/unistd_64.h; asm-generic/unistd.h on arm64)
_TABLES = {
    "x86_64": (0xC000003E, {
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64, "unshare": 272,
        "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "userfaultfd": 323,
        "bpf": 321, "perf_event_open": 298, "io_uring_setup": 425, "keyctl": 250, "add_key": 248,
        "request_key": 249, "clone": 56, "clone3": 435, "socket": 41, "setsockopt": 54, "rt_sigaction": 13}),
    "aarch64": (0xC00000B7, {
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190, "unshare": 97,
        "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "userfaultfd": 282,
        "bpf": 280, "perf_event_open": 241, "io_uring_setup": 425, "keyctl": 219, "add_key": 217,
        "request_key": 218, "clone": 220, "clone3": 435, "socket": 198, "setsockopt": 208, "rt_sigaction": 134}),
}


def _arg(index: int, high: bool = False) -> int:
    """The offset of a system call argument's low (or high) 32-bit word in struct seccomp_data."""
    return 16 + 8 * index + 4 * high


def _assemble(program: list) -> bytes:
    """Instructions (code, k, jump if true, jump if false) with jumps given as label names (None: the next
    instruction), and labels as plain strings, into the bytes of a `struct sock_filter` array."""
    places, count = {}, 0
    for item in program:
        if isinstance(item, str):
            places[item] = count
        else:
            count += 1
    out, pc = [], 0
    for item in program:
        if isinstance(item, str):
            continue
        code, k, *jumps = item
        jt, jf = (places[jump] - pc - 1 if jump is not None else 0 for jump in (jumps or [None, None]))
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError(f"instruction {pc} jumps {jt}, {jf}: classic BPF jumps forward by at most 255")
        out.append(struct.pack("=HBBI", code, jt, jf, k))
        pc += 1
    return b"".join(out)


@functools.cache
def sandbox_filter(machine: str | None = None) -> bytes:
    """The filter for this machine (`platform.machine()`), as the bytes of its `struct sock_filter` array (built once:
    every sandboxed call installs it)."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        raise ConfigError(f"the python tool's sandbox filters system calls on {' and '.join(_TABLES)} machines, not "
                          f"{machine}; run the python tool on one of those.")
    arch, nr = _TABLES[machine]
    load = (_LD_W_ABS, _NR)
    program = [(_LD_W_ABS, _ARCH), (_JEQ_K, arch, None, "kill"), load]
    if machine == "x86_64":
        program.append((_JGE_K, _X32_BIT, "kill", None))
    for name in _REFUSED:
        program.append((_JEQ_K, nr[name], "refuse", None))
    program += [
        (_JEQ_K, nr["clone3"], "absent", None),
        # clone with a namespace flag
        (_JEQ_K, nr["clone"], None, "socket"), (_LD_W_ABS, _arg(0)), (_JSET_K, _NAMESPACE_FLAGS, "refuse", "allow"),
        # a socket of another family than AF_UNIX
        "socket", (_JEQ_K, nr["socket"], None, "setsockopt"), (_LD_W_ABS, _arg(0)),
        (_JEQ_K, _AF_UNIX, "allow", "refuse"),
        # SO_SNDBUF / SO_RCVBUF
        "setsockopt", (_JEQ_K, nr["setsockopt"], None, "sigaction"), (_LD_W_ABS, _arg(1)),
        (_JEQ_K, _SOL_SOCKET, None, "allow"), (_LD_W_ABS, _arg(2)), (_JEQ_K, _SO_SNDBUF, "refuse", None),
        (_JEQ_K, _SO_RCVBUF, "refuse", "allow"),
        # a new action for SIGCHLD or SIGXFSZ (a NULL one only reads the current)
        "sigaction", (_JEQ_K, nr["rt_sigaction"], None, "allow"), (_LD_W_ABS, _arg(0)),
        (_JEQ_K, signal.SIGCHLD, "new action", None), (_JEQ_K, signal.SIGXFSZ, None, "allow"),
        "new action", (_LD_W_ABS, _arg(1)), (_JEQ_K, 0, None, "refuse"), (_LD_W_ABS, _arg(1, high=True)),
        (_JEQ_K, 0, "allow", "refuse"),
        "allow", (_RET_K, _RET_ALLOW),
        "refuse", (_RET_K, _REFUSE),
        "absent", (_RET_K, _ABSENT),
        "kill", (_RET_K, _RET_KILL_PROCESS),
    ]
    return _assemble(program)
