"""The tools of multi-turn rollouts: each sandbox limit stops real code (a fork bomb, 8 GB, a socket, writes
outside, sleeping and spinning forever) with a short answer, leaves the host as it was and the ToolBox working;
bad calls are answers, not exceptions; truncation, the calculator, custom tools and the tool config file."""

import os
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mindrl.config import ConfigError
from mindrl.tools import ToolBox, ToolCall, check_sandbox, load_toolbox, truncate

ROOT = Path(__file__).resolve().parents[1]
#: the sandbox's limits in these tests: short, so a stop shows in a second or two
LIMITS = {"timeout_s": 2, "cpu_seconds": 1, "max_processes": 32}


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    settings = ", ".join(f"{key}: {value}" for key, value in LIMITS.items())
    path = _config(tmp_path_factory.mktemp("tools"), f"""
        tools:
          - name: python
            config: {{{settings}}}
          - name: calculator
        """)
    with load_toolbox(path, max_parallel_calls=4, max_tool_response_length=2000, truncate_side="middle") as toolbox:
        yield toolbox


@pytest.fixture(scope="module")
def long_box(tmp_path_factory):
    """A wall clock far past the other limits, so they stop the code first even on a loaded machine (which gives
    a busy loop less than a core)."""
    settings = "{timeout_s: 10, cpu_seconds: 1}"
    path = _config(tmp_path_factory.mktemp("tools"), f"tools:\n  - name: python\n    config: {settings}\n")
    with load_toolbox(path, 1, 2000, "left") as toolbox:
        yield toolbox


@pytest.fixture
def host(tmp_path):
    """What the sandbox must leave alone: a folder of the test's, the repository and the home directory."""
    folder = tmp_path / "host"
    folder.mkdir()

    def names() -> dict[Path, set[str]]:
        return {path: set(os.listdir(path)) for path in (folder, ROOT, Path.home())}

    before = names()
    yield folder
    assert names() == before


def _python(box: ToolBox, code: str):
    start = time.monotonic()
    [result] = box.run([ToolCall("python", {"code": textwrap.dedent(code)})])
    return result, time.monotonic() - start


def _stopped(box: ToolBox, result, status: str, says: str) -> None:
    """Stopped with `status`, a short answer that says why, and the ToolBox answers the next call."""
    assert result.status == status, result
    assert says in result.text and len(result.text) < 1500, result.text
    assert [(r.text, r.status) for r in box.run([ToolCall("python", {"code": "print(1+1)"})])] == [("2\n", "ok")]


# --- the sandbox ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["tmp", "repo", "home"])
def test_code_cannot_write_outside_its_directory(box, host, target):
    path = {"tmp": host / "escaped", "repo": ROOT / "escaped_from_sandbox",
            "home": Path.home() / "escaped_from_sandbox"}[target]
    result, _ = _python(box, f"open({str(path)!r}, 'w').write('out')")
    _stopped(box, result, "error", "Error")
    assert not path.exists()


def test_code_writes_in_its_own_directory(box, host):
    result, _ = _python(box, """
        import os
        open("notes.txt", "w").write("kept")
        open("/tmp/scratch", "w").write("kept")
        print(os.getcwd(), open("notes.txt").read(), open("/tmp/scratch").read())
        """)
    assert (result.text, result.status) == ("/box kept kept\n", "ok")


def test_code_cannot_reach_a_socket_on_the_hosts_loopback(box, host):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        result, _ = _python(box, f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"out")
            """)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected
    _stopped(box, result, "error", "PermissionError")  # no socket but a Unix one can even be made


def _sandbox() -> str | None:
    """The pid namespace of the sandbox this process runs now: its bwrap's child's. Counting by uid would count
    the sandboxes of other processes on the machine too (nobody's, or the user's)."""
    me = os.getpid()
    mine = os.readlink(f"/proc/{me}/ns/pid")
    for task in os.listdir(f"/proc/{me}/task"):  # a child is listed under the thread that started it
        with open(f"/proc/{me}/task/{task}/children") as f:
            for bwrap in f.read().split():
                try:
                    with open(f"/proc/{bwrap}/task/{bwrap}/children") as g:
                        spaces = {os.readlink(f"/proc/{child}/ns/pid") for child in g.read().split()}
                except OSError:  # it ended while we looked
                    continue
                # other children of this process (the rank server an earlier test of the session started, say)
                # and their children live in this process's namespace: the sandbox is the one that does not
                if spaces - {mine}:
                    return (spaces - {mine}).pop()
    return None


def _processes_in(namespace: str) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            count += os.readlink(f"/proc/{pid}/ns/pid") == namespace
        except OSError:  # it ended while we looked
            pass
    return count


@pytest.mark.timeout(60)
def test_a_fork_bomb_is_held_to_its_process_cap_and_leaves_nothing_behind(box, host):
    namespace, peak, done = [None], [0], threading.Event()

    def watch():
        while not done.is_set():
            namespace[0] = namespace[0] or _sandbox()
            if namespace[0]:
                peak[0] = max(peak[0], _processes_in(namespace[0]))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:  # the worst kind: a refused fork is ignored and tried again
        result, seconds = _python(box, """
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
            """)
    finally:
        done.set()
        watcher.join()
    # its processes' CPU seconds together run out first, or (on a loaded machine) the wall clock
    assert result.status == "timeout" and seconds < LIMITS["timeout_s"] + 1.5, (result, seconds)
    # bwrap's init and the launcher are the 2
    assert LIMITS["max_processes"] // 2 < peak[0] <= LIMITS["max_processes"] + 2, peak
    deadline = time.monotonic() + 5
    while _processes_in(namespace[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_in(namespace[0]) == 0
    _stopped(box, result, "timeout", "Stopped: the code ")


def test_a_fork_loop_that_gives_up_is_told_the_process_cap(long_box, host):
    result, seconds = _python(long_box, "import os\nwhile True:\n    os.fork()\n")
    _stopped(long_box, result, "killed", "more than 32 processes")
    assert seconds < 10


def test_eight_gigabytes_are_refused(box, host):
    result, seconds = _python(box, "data = bytearray(8 << 30)\nprint(len(data))")
    _stopped(box, result, "killed", "ran out of its 512 MB of memory")
    assert seconds < LIMITS["timeout_s"]


def test_a_caught_memory_error_still_got_no_memory(box, host):
    result, _ = _python(box, """
        try:
            data = bytearray(8 << 30)
        except MemoryError:
            data = b""
        print(len(data))
        """)
    assert (result.text, result.status) == ("0\n", "ok")


@pytest.mark.timeout(60)
def test_sleeping_forever_is_stopped_by_the_wall_clock(box, host):
    result, seconds = _python(box, "import time\nwhile True:\n    time.sleep(1)\n")
    assert LIMITS["timeout_s"] <= seconds < LIMITS["timeout_s"] + 1, seconds
    _stopped(box, result, "timeout", f"its {LIMITS['timeout_s']} s wall-clock limit")


@pytest.mark.timeout(60)
def test_a_busy_loop_is_stopped_by_its_cpu_seconds(long_box, host):
    result, seconds = _python(long_box, "print('spinning', flush=True)\nwhile True:\n    pass\n")
    _stopped(long_box, result, "timeout", "used up its 1 CPU seconds")
    assert 1 <= seconds < 10, seconds
    assert result.text.startswith("spinning\n")  # what it printed before comes back


@pytest.mark.timeout(60)
def test_a_busy_loop_that_ignores_sigxcpu_is_stopped_at_its_cpu_seconds_all_the_same(long_box, host):
    result, seconds = _python(long_box, """
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True:
            pass
        """)
    _stopped(long_box, result, "timeout", "used up its 1 CPU seconds")  # watched from outside: no signal to ignore
    assert 1 <= seconds < 10, seconds  # a loaded machine gives the loop less than a core


def test_output_past_the_file_limit_is_cut_off(tmp_path, host):
    path = _config(tmp_path, "tools:\n  - name: python\n    config: {file_mb: 1}\n")
    with load_toolbox(path, 1, 100, "left") as toolbox:
        result, _ = _python(toolbox, "while True:\n    print('x' * 10000)\n")
        assert result.status == "killed" and result.text.startswith("x" * 100 + "...(truncated)"), result


def test_the_code_sees_none_of_the_callers_environment(box, monkeypatch):
    monkeypatch.setenv("MINDRL_TEST_SECRET", "hunter2")
    result, _ = _python(box, "import os\nprint(sorted(os.environ))")
    assert "MINDRL_TEST_SECRET" not in result.text and result.status == "ok"


def test_check_sandbox_passes_here():
    check_sandbox()


def test_check_sandbox_says_in_one_sentence_why_it_cannot_start(monkeypatch, tmp_path):
    monkeypatch.setenv("MINDRL_BWRAP", str(tmp_path / "no-bwrap"))
    with pytest.raises(ConfigError, match=r"sandbox cannot start here .*no-bwrap") as refusal:
        check_sandbox()
    assert str(refusal.value).count(". ") == 0 and str(refusal.value).endswith(".")


# --- calls, concurrency, truncation ------------------------------------------------------------------------------

def test_bad_calls_are_answers_not_exceptions(box):
    results = box.run([ToolCall(None, {}, error="the tool call is not valid JSON"),
                       ToolCall("pyhton", {"code": "1"}),
                       ToolCall("python", {}),
                       ToolCall("python", {"code": "1", "timeout": 5}),
                       ToolCall("python", {"code": 1}),
                       ToolCall("calculator", ["1+1"])])
    assert [(r.status, r.text) for r in results] == [
        ("error", "the tool call is not valid JSON"),
        ("error", "unknown tool 'pyhton'; tools: python, calculator"),
        ("error", "bad arguments for python: missing 'code'; call it as python(code: string)."),
        ("error", "bad arguments for python: it takes no argument 'timeout'; call it as python(code: string)."),
        ("error", "bad arguments for python: 'code' must be a JSON string; call it as python(code: string)."),
        ("error", "bad arguments for calculator: the arguments must be a JSON object; call it as "
                  "calculator(expression: string)."),
    ]


def test_a_turns_calls_run_concurrently_and_come_back_in_order(box):
    calls = [ToolCall("python", {"code": f"import time\ntime.sleep(1)\nprint({n})"}) for n in range(4)]
    start = time.monotonic()
    results = box.run(calls)
    assert time.monotonic() - start < 3  # one after another: over 4 s
    assert [r.text for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(1 <= r.seconds < 3 for r in results)


@pytest.mark.parametrize(("side", "cut"), [
    ("left", "abcd...(truncated)"),
    ("right", "(truncated)...ghij"),
    ("middle", "ab...(truncated)...ij"),
    ("both", "ab...(truncated)...ij"),
])
def test_truncation_keeps_the_side_it_is_told(side, cut):
    assert truncate("abcdefghij", 4, side) == cut
    assert truncate("abcdefghij", 10, side) == "abcdefghij"
    assert truncate("abcdefghij", 0, side) == "abcdefghij"


def test_an_odd_middle_cut_keeps_the_larger_half_at_the_head():
    assert truncate("abcdefghij", 5, "middle") == "abc...(truncated)...ij"
    assert truncate("abcdefghij", 1, "middle") == "a...(truncated)..."


# --- the calculator ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("expression", "answer"), [
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("-2 ** 2", "-4"),
    ("(-2) ** 3", "-8"),
    ("7 / 2", "3.5"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("2 ** -1", "0.5"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("1.5e3 + .5", "1500.5"),
    ("+3", "3"),
])
def test_the_calculator_computes(box, expression, answer):
    assert [(r.text, r.status) for r in box.run([ToolCall("calculator", {"expression": expression})])] == [
        (answer, "ok")]


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os').system('id')", "a function call is not allowed"),
    ("os", "the name 'os' is not allowed"),
    ("().__class__", "a Attribute node is not allowed"),
    ("2 ** 10 ** 10", "would have more than 13288 bits"),
    ("(10 ** 4000) * (10 ** 4000)", "the result has more than 13288 bits"),
    ("1 / 0", "it divides by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("2.0 ** 10000", "too large for a float"),
    ("1 +", "not an arithmetic expression"),
    ("'text'", "the constant 'text' is not allowed"),
    ("True + 1", "the constant True is not allowed"),
    ("[1, 2]", "a List node is not allowed"),
])
def test_the_calculator_refuses(box, expression, why):
    start = time.monotonic()
    [result] = box.run([ToolCall("calculator", {"expression": expression})])
    assert result.status == "error" and why in result.text, result
    assert time.monotonic() - start < 1


# --- custom tools and the tool config file -----------------------------------------------------------------------

@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        def lookup(word: str, upper: bool = False, table=None):
            """Look a word up in the table.

            More text the model does not need."""
            answer = (table or {}).get(word, "unknown")
            return answer.upper() if upper else answer

        def positional_only(word, /):
            return word

        def broken(word: str):
            raise KeyError(word)
        '''))
    return path


def test_a_custom_tool_with_settings_and_a_derived_schema(custom_file):
    path = _config(custom_file.parent, f"""
        tools:
          - name: {custom_file}:lookup
            config: {{table: {{cat: chat}}}}
          - name: {custom_file}:broken
        """)
    with load_toolbox(path, 2, 0, "left") as toolbox:
        assert toolbox.schemas()[0] == {"type": "function", "function": {
            "name": "lookup", "description": "Look a word up in the table.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}, "upper": {"type": "boolean"}},
                           "required": ["word"]}}}
        results = toolbox.run([ToolCall("lookup", {"word": "cat"}), ToolCall("lookup", {"word": "cat", "upper": True}),
                               ToolCall("lookup", {"word": "cat", "table": {}}), ToolCall("broken", {"word": "x"})])
    assert [(r.text, r.status) for r in results] == [
        ("chat", "ok"), ("CHAT", "ok"),
        ("bad arguments for lookup: it takes no argument 'table'; call it as lookup(word: string, upper: boolean).",
         "error"),
        ("broken failed: KeyError: 'x'", "error")]


def test_a_module_function_with_its_own_schema(tmp_path):
    path = _config(tmp_path, """
        tools:
          - name: os.path:basename
            tool_schema:
              type: function
              function: {name: basename, description: last part of a path,
                         parameters: {type: object, properties: {p: {type: string}}, required: [p]}}
        """)
    with load_toolbox(path, 1, 0, "left") as toolbox:
        assert [r.text for r in toolbox.run([ToolCall("basename", {"p": "/a/b.txt"})])] == ["b.txt"]


@pytest.mark.parametrize(("entry", "refusal"), [
    ("name: {file}:positional_only",
     r"tool 'positional_only' cannot be called as positional_only\(\) \(missing a required argument: 'word'\)"),
    ("name: {file}:lookup\n    tool_schema: {{name: lookup, parameters: {{properties: {{term: {{type: string}}}}}}}}",
     r"tool 'lookup' cannot be called as lookup\(term: string\)"),
    ("name: {file}:lookup\n    config: {{colour: red}}", "tool '.*:lookup' has no parameter 'colour'"),
    ("name: {file}:lookup\n    config: {{word: cat}}\n    tool_schema: {{name: lookup, parameters: {{properties: "
     "{{word: {{}}}}}}}}", "'word' is both a setting .* and an argument"),
    ("name: {file}:missing", "has no function 'missing'"),
    ("name: {dir}/nowhere.py:f", "nowhere.py does not exist"),
    ("name: no_such_module_here:f", "cannot import 'no_such_module_here'"),
    ("name: pyhton", "unknown tool 'pyhton'; known: calculator, python"),
    ("class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool", "needs a name: .*in place of verl class_name"),
    ("name: python\n    config: {{timeout: 5}}", "the python tool has no setting 'timeout'; its settings: timeout_s"),
    ("name: python\n    config: {{memory_mb: -1}}", "memory_mb is -1; it must be a positive integer"),
    ("name: python\n    tool_schema: {{name: run, parameters: {{properties: {{source: {{}}}}}}}}",
     r"cannot be called as run\(source\)"),
    ("name: python\n    tool_schema: {{name: run, parameters: {{properties: {{}}, required: [code]}}}}",
     "tool_schema requires 'code', which is not among its properties"),
    ("name: calculator\n    config: {{precision: 3}}", "the calculator tool has no setting 'precision'"),
    ("name: calculator\n    timeout: 3", "unknown key 'timeout'; an entry has name, config, tool_schema"),
])
def test_a_tool_config_mistake_is_one_sentence_naming_the_file(custom_file, entry, refusal):
    entry = entry.format(file=custom_file, dir=custom_file.parent)
    path = _config(custom_file.parent, f"tools:\n  - {entry}\n")
    with pytest.raises(ConfigError, match=refusal) as raised:
        load_toolbox(path, 1, 0, "left")
    assert str(raised.value).startswith(path) or "custom tool" in str(raised.value), raised.value


def test_two_tools_of_one_name_are_refused(tmp_path):
    path = _config(tmp_path, "tools:\n  - name: calculator\n  - name: calculator\n")
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        load_toolbox(path, 1, 0, "left")


def test_the_shipped_tool_configs_load():
    with load_toolbox(str(ROOT / "configs" / "tools" / "python_calculator.yaml"), 2, 0, "left") as toolbox:
        assert [s["function"]["name"] for s in toolbox.schemas()] == ["python", "calculator"]
    with load_toolbox(str(ROOT / "configs" / "tools" / "retool_python.yaml"), 2, 0, "left") as toolbox:
        [schema] = toolbox.schemas()
        assert schema["function"]["name"] == "code_interpreter"
        assert [r.text for r in toolbox.run([ToolCall("code_interpreter", {"code": "print(6 * 7)"})])] == ["42\n"]


def test_no_config_gives_the_builtins():
    with load_toolbox(None, 1, 0, "left") as toolbox:
        assert [s["function"]["name"] for s in toolbox.schemas()] == ["python", "calculator"]
    with pytest.raises(ConfigError, match="max_parallel_calls is 0"):
        load_toolbox(None, 0, 0, "left")
