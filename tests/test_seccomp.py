"""The sandbox's seccomp filter (mindrl/tools/seccomp.py), run by a small classic-BPF interpreter written here from
the kernel's definitions, on both machines' tables: every refused call refused, ordinary ones allowed, the argument
rules (clone's namespace flags, socket families, buffer sizes, SIGCHLD / SIGXFSZ actions) on each side of their
line. tests/test_sandbox_bounds.py runs the filter in the kernel."""

import errno
import struct

import pytest

from mindrl.config import ConfigError
from mindrl.tools.seccomp import _REFUSED, _TABLES, sandbox_filter

ALLOW, KILL = 0x7FFF0000, 0x80000000
REFUSE, ABSENT = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
#: ordinary calls by number: read/write/openat/mmap/exit_group on x86-64, and their arm64 numbers
ORDINARY = {"x86_64": (0, 1, 257, 9, 231), "aarch64": (63, 64, 56, 222, 94)}


def run(program: bytes, nr: int, arch: int, *args: int) -> int:
    """The action the filter returns for one system call (struct seccomp_data: nr, arch, ip, args[6])."""
    instructions = [struct.unpack_from("=HBBI", program, offset) for offset in range(0, len(program), 8)]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    pc = accumulator = 0
    while True:
        code, jt, jf, k = instructions[pc]
        if code == 0x20:  # ld [k]
            accumulator, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unknown opcode {code:#x}")


@pytest.mark.parametrize("machine", sorted(_TABLES))
def test_each_refused_call_is_refused_and_ordinary_calls_pass(machine):
    program, (arch, nr) = sandbox_filter(machine), _TABLES[machine]
    for name in _REFUSED:
        assert run(program, nr[name], arch) == REFUSE, name
    for number in ORDINARY[machine]:
        assert run(program, number, arch) == ALLOW, number
    assert run(program, nr["clone3"], arch) == ABSENT  # the C library falls back to clone
    assert run(program, ORDINARY[machine][0], 0x40000003) == KILL  # another ABI (i386)
    if machine == "x86_64":
        assert run(program, 0x40000000 | 1, arch) == KILL  # x32


@pytest.mark.parametrize("machine", sorted(_TABLES))
def test_argument_rules_on_each_side_of_their_line(machine):
    program, (arch, nr) = sandbox_filter(machine), _TABLES[machine]
    fork, thread = 0x11, 0x3D0F00  # SIGCHLD; CLONE_VM | FS | FILES | SIGHAND | THREAD | SYSVSEM | SETTLS | ...
    assert run(program, nr["clone"], arch, fork) == ALLOW and run(program, nr["clone"], arch, thread) == ALLOW
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80):
        assert run(program, nr["clone"], arch, fork | flag) == REFUSE, hex(flag)
    assert run(program, nr["socket"], arch, 1, 1) == ALLOW  # AF_UNIX, SOCK_STREAM
    for family in (2, 10, 16, 17):  # inet, inet6, netlink, packet
        assert run(program, nr["socket"], arch, family, 1) == REFUSE, family
    for option, action in ((7, REFUSE), (8, REFUSE), (2, ALLOW), (9, ALLOW)):  # SNDBUF, RCVBUF, REUSEADDR, KEEPALIVE
        assert run(program, nr["setsockopt"], arch, 3, 1, option) == action, option
    assert run(program, nr["setsockopt"], arch, 3, 6, 7) == ALLOW  # level IPPROTO_TCP: not the buffers
    for signal_number, action in ((17, REFUSE), (25, REFUSE), (2, ALLOW), (13, ALLOW)):
        assert run(program, nr["rt_sigaction"], arch, signal_number, 0x7FFF0000) == action, signal_number
        assert run(program, nr["rt_sigaction"], arch, signal_number, 1 << 40) == action  # a pointer's high word
        assert run(program, nr["rt_sigaction"], arch, signal_number, 0) == ALLOW  # only reading the action


def test_another_machine_is_one_sentence():
    with pytest.raises(ConfigError, match="filters system calls on x86_64 and aarch64 machines, not riscv64"):
        sandbox_filter("riscv64")
