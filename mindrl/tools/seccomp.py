"""The system calls the sandboxed code may not make, as a seccomp filter (a classic BPF program).

rlimits bound what a process maps and writes, not every way to hold the host's memory, and a user namespace lets
its owner mount a fresh, unbounded tmpfs. So the code may not:
- create anonymous files or System V IPC objects (`memfd_create` + `fallocate` and `shmget` held gigabytes outside
  RLIMIT_AS; a message queue holds kernel memory too): every file it writes is on a size- and inode-capped tmpfs;
- make namespaces or mounts (`unshare`, `setns`, `mount` and the new mount API, `clone`/`clone3` with a namespace
  flag): a nested user and mount namespace is where an unbounded tmpfs would come from;
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
import platform
import struct

from mindrl.config.errors import ConfigError

# BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (args[0]'s low word: little endian)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
#: x86-64's x32 ABI marks its calls with this bit
_X32_BIT = 0x40000000
#: clone flags that make a namespace
_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

_REFUSED = ("memfd_create", "memfd_secret", "shmget", "msgget", "unshare", "setns", "mount", "umount2", "pivot_root",
            "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "userfaultfd",
            "bpf", "perf_event_open", "io_uring_setup", "keyctl", "add_key", "request_key")

#: machine → (AUDIT_ARCH, {name: number}) for the native ABI (asm/unistd_64.h; asm-generic/unistd.h on arm64)
_TABLES = {
    "x86_64": (0xC000003E, {
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "userfaultfd": 323, "bpf": 321,
        "perf_event_open": 298, "io_uring_setup": 425, "keyctl": 250, "add_key": 248, "request_key": 249,
        "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, {
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "unshare": 97, "setns": 268,
        "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "userfaultfd": 282, "bpf": 280,
        "perf_event_open": 241, "io_uring_setup": 425, "keyctl": 219, "add_key": 217, "request_key": 218,
        "clone": 220, "clone3": 435}),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def sandbox_filter(machine: str | None = None) -> bytes:
    """The filter for this machine (`platform.machine()`), as the bytes of its `struct sock_filter` array."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        raise ConfigError(f"the python tool's sandbox filters system calls on {' and '.join(_TABLES)} machines, not "
                          f"{machine}; run the python tool on one of those.")
    arch, numbers = _TABLES[machine]
    refuse, not_there = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    body = [_op(_LD_W_ABS, _NR)]
    if machine == "x86_64":
        body.append(_op(_JGE_K, _X32_BIT, 0, 1))
        body.append(_op(_RET_K, _RET_KILL_PROCESS))
    for name in _REFUSED:  # each: equal → the next instruction (refuse), else skip it
        body += [_op(_JEQ_K, numbers[name], 0, 1), _op(_RET_K, refuse)]
    body += [_op(_JEQ_K, numbers["clone3"], 0, 1), _op(_RET_K, not_there),
             _op(_JEQ_K, numbers["clone"], 0, 3), _op(_LD_W_ABS, _ARG0_LOW),
             _op(_JSET_K, _NAMESPACE_FLAGS, 0, 1), _op(_RET_K, refuse),
             _op(_RET_K, _RET_ALLOW)]
    head = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, 1, 0), _op(_RET_K, _RET_KILL_PROCESS)]
    return b"".join(head + body)
