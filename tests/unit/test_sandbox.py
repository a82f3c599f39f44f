"""The sandboxed `python` tool (colocate/envs/sandbox.py): real child processes, small limits."""

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from colocate.envs import sandbox
from colocate.envs.sandbox import SandboxResult, network_isolation, python, run_python


def _timed(code, **limits):
    start = time.monotonic()
    result = run_python(code, **limits)
    return result, time.monotonic() - start


# ---------------------------------------------------------------------------------- output


def test_prints_come_back():
    result = run_python("print('hello')\nprint(6 * 7)")
    assert (result.stdout, result.stderr) == ("hello\n42\n", "")
    assert (result.exit_reason, result.exit_code) == ("ok", 0)
    assert result.as_text() == "hello\n42"
    assert 0 < result.seconds < 5


def test_unicode_round_trips():
    assert run_python("print('é 漢字 \\U0001F600')").stdout == "é 漢字 \U0001f600\n"


def test_exception_is_an_error_with_a_short_traceback():
    result = run_python("x = 1\ny = x / 0\n")
    assert (result.exit_reason, result.exit_code, result.stdout) == ("error", 1, "")
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<tool>", line 2, in <module>\n    y = x / 0\n' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox" not in result.stderr  # the bootstrap's frames are left out
    assert result.as_text().endswith("ZeroDivisionError: division by zero\n[error] exit code 1")


def test_syntax_error():
    result = run_python("print(")
    assert (result.exit_reason, result.exit_code) == ("error", 1)
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().endswith("SyntaxError: '(' was never closed")


@pytest.mark.parametrize(
    "code, reason, exit_code",
    [
        ("import sys; sys.exit(0)", "ok", 0),
        ("import sys; sys.exit(3)", "error", 3),
        ("import os; os._exit(5)", "error", 5),
    ],
)
def test_exit_status(code, reason, exit_code):
    result = run_python(code)
    assert (result.exit_reason, result.exit_code) == (reason, exit_code)


def test_stdin_is_empty():
    result = run_python("print(input())")
    assert result.exit_reason == "error"
    assert result.stderr.rstrip().endswith("EOFError: EOF when reading a line")


def test_output_is_truncated_and_says_so():
    result = run_python("print('a' * 10000)", max_output_chars=100)
    # 10001 characters (with the newline): the first 50 and the last 50 are kept.
    assert result.stdout == "a" * 50 + "\n... [truncated 9901 chars] ...\n" + "a" * 49 + "\n"
    assert (result.exit_reason, result.truncated_chars) == ("ok", 9901)
    assert "[truncated 9901 chars]" in result.as_text()


def test_endless_output_is_stopped():
    result, elapsed = _timed("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output_chars=100, timeout_s=10)
    assert (result.exit_reason, result.exit_code) == ("output_limit", None)
    assert result.truncated_chars > sandbox.OUTPUT_KILL_BYTES - 65536
    assert len(result.stdout) < 200
    assert result.as_text().endswith(f"[output_limit] stopped after printing more than {sandbox.OUTPUT_KILL_BYTES} bytes")
    assert elapsed < 5


# ---------------------------------------------------------------------------------- limits


def test_infinite_loop_hits_the_cpu_limit():
    result, elapsed = _timed("while True:\n    pass", cpu_s=1, timeout_s=5)
    assert (result.exit_reason, result.exit_code) == ("cpu_limit", -24)  # SIGXCPU
    assert 0.9 < result.cpu_seconds < 2.1
    assert elapsed < 4
    assert result.as_text() == "[cpu_limit] stopped at the CPU time limit of 1 s"


def test_sleep_stops_at_the_wall_clock_limit():
    result, elapsed = _timed("import time\nprint('before', flush=True)\ntime.sleep(100)", timeout_s=1)
    assert (result.exit_reason, result.exit_code) == ("timeout", None)
    assert result.stdout == "before\n"  # what was printed before the kill is kept
    assert 0.9 < elapsed < 3
    assert result.as_text() == "before\n[timeout] stopped at the wall-clock limit of 1 s"


def test_memory_hog_hits_the_memory_limit():
    result = run_python("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert (result.exit_reason, result.exit_code) == ("memory_limit", 213)
    assert result.stderr.rstrip().endswith("MemoryError")
    assert result.as_text().endswith("[memory_limit] out of memory (limit 256 MB)")


def test_file_size_is_capped():
    result = run_python("with open('big', 'wb') as f:\n    f.write(b'x' * (2 * 1024**2))", file_mb=1)
    assert result.exit_reason == "error"
    assert result.stderr.rstrip().endswith("OSError: [Errno 27] File too large")


# ---------------------------------------------------------------------------------- network


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    return server


def test_connect_is_refused():
    with _listener() as server:
        port = server.getsockname()[1]
        result = run_python(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')")
        assert (result.exit_reason, result.stdout) == ("error", "")
        assert result.stderr.rstrip().endswith(
            "PermissionError: [Errno 13] sandbox: network access (socket.connect) is not allowed"
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing got through


def test_name_lookup_is_refused():
    result = run_python("import socket\nprint(socket.getaddrinfo('example.com', 80))")
    assert (result.exit_reason, result.stdout) == ("error", "")
    assert result.stderr.rstrip().endswith(
        "PermissionError: [Errno 13] sandbox: network access (socket.getaddrinfo) is not allowed"
    )


def test_network_namespace_without_the_guard():
    """Where the kernel lets the child unshare, even code past the audit hook reaches nothing: the
    new namespace has no interface up, loopback included."""
    if network_isolation() == "none":
        pytest.skip("no network namespace on this machine (the audit hook alone guards)")
    with _listener() as server:
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        result = sandbox._run(code, timeout_s=5, cpu_s=5, memory_mb=512, max_output_chars=4096, file_mb=1, guard=False)
        assert (result.exit_reason, result.stdout) == ("error", "")
        assert result.stderr.rstrip().endswith("OSError: [Errno 101] Network is unreachable")
        with pytest.raises(BlockingIOError):
            server.accept()


# ---------------------------------------------------------------------------------- files


def test_writing_outside_fails(tmp_path):
    target = tmp_path / "escape.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert result.exit_reason == "error"
    assert result.stderr.rstrip().endswith(
        f"PermissionError: [Errno 13] sandbox: writing outside the working directory is not allowed: '{target}'"
    )
    assert not target.exists()


@pytest.mark.parametrize(
    "op",
    [
        "os.remove(T)",
        "os.rename(T, 'moved')",
        "shutil.rmtree(D)",
        "os.chmod(T, 0)",
        "os.symlink(D, 'link'); open('link/new.txt', 'w')",
        "os.link(T, 'hard'); open('hard', 'a').write('x')",
    ],
)
def test_changing_files_outside_fails(tmp_path, op):
    victim = tmp_path / "keep.txt"
    victim.write_text("original")
    result = run_python(f"import os, shutil\nT, D = {str(victim)!r}, {str(tmp_path)!r}\n{op}")
    assert result.exit_reason == "error"
    assert "PermissionError: [Errno 13] sandbox:" in result.stderr
    assert victim.read_text() == "original"
    assert os.stat(victim).st_mode & 0o777 != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_reading_outside_works(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("42")
    result = run_python(f"import json, math, pathlib\nprint(math.isqrt(int(pathlib.Path({str(data)!r}).read_text())))")
    assert (result.exit_reason, result.stdout) == ("ok", "6\n")


def test_credential_files_are_not_even_readable(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("hf_secret")
    monkeypatch.setattr(sandbox, "_SECRET_PATHS", (str(token),))
    result = run_python(f"print(open({str(token)!r}).read())")
    assert (result.exit_reason, result.stdout) == ("error", "")
    assert result.stderr.rstrip().endswith(f"PermissionError: [Errno 13] sandbox: reading this file is not allowed: '{token}'")


def test_writing_inside_works():
    code = (
        "import os, pathlib, shutil, tempfile\n"
        "pathlib.Path('a.txt').write_text('one')\n"
        "os.makedirs('d/e')\n"
        "os.rename('a.txt', 'd/e/b.txt')\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
        "    f.write('two')\n"
        "(pathlib.Path.home() / 'c.txt').write_text(open(f.name).read())\n"
        "shutil.rmtree('d/e')\n"
        "print(sorted(p for p in os.listdir('.') if not p.startswith('tmp')), open('c.txt').read())"
    )
    result = run_python(code)
    assert (result.exit_reason, result.stdout) == ("ok", "['c.txt', 'd'] two\n")


def test_private_directory_is_fresh_and_removed():
    code = "import os, tempfile\nprint(os.getcwd())\nprint(os.environ['HOME'], tempfile.gettempdir())\nprint(os.listdir('.'))"
    result = run_python(code)
    cwd, home_and_tmp, listing = result.stdout.splitlines()
    assert os.path.basename(cwd).startswith("colocate-sandbox-")
    assert home_and_tmp == f"{cwd} {cwd}"
    assert listing == "[]"  # the code file is gone before the code runs
    assert not os.path.exists(cwd)


@pytest.mark.parametrize(
    "code, limits",
    [
        ("import os\nos.makedirs('a/b')\nos.chmod('a/b', 0)\nos.chmod('a', 0)\nos.chmod('.', 0)\nprint(os.getcwd())", {}),
        ("import os, time\nopen('f', 'w').write('x')\nprint(os.getcwd(), flush=True)\ntime.sleep(100)", {"timeout_s": 1}),
    ],
)
def test_private_directory_is_removed_whatever_the_code_did(code, limits):
    result = run_python(code, **limits)
    cwd = result.stdout.split()[0]
    assert os.path.basename(cwd).startswith("colocate-sandbox-")
    assert not os.path.exists(cwd)


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("COLOCATE_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    names, cuda = result.stdout.splitlines()
    assert "COLOCATE_TEST_SECRET" not in names
    assert cuda == "''"
    assert "'PATH'" in names and "'HOME'" in names


# ---------------------------------------------------------------------------------- processes and bypasses


@pytest.mark.parametrize(
    "code, event",
    [
        ("import subprocess\nsubprocess.run(['echo', 'hi'])", "subprocess.Popen"),
        ("import os\nos.system('echo hi')", "os.system"),
        ("import os\nos.fork()", "os.fork"),
        ("import os\nos.execv('/bin/echo', ['echo', 'hi'])", "os.exec"),
        ("import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})", "os.posix_spawn"),
    ],
)
def test_spawning_a_process_is_refused(code, event):
    result = run_python(code)
    assert (result.exit_reason, result.stdout) == ("error", "")
    assert result.stderr.rstrip().endswith(f"PermissionError: [Errno 13] sandbox: starting a process ({event}) is not allowed")


@pytest.mark.parametrize(
    "code, message",
    [
        ("import ctypes\nctypes.CDLL(None).system(b'echo hi')", "sandbox: ctypes.dlopen is not allowed"),
        ("import ctypes\nctypes.string_at(id(1), 8)", "sandbox: ctypes.string_at is not allowed"),
        ("import ctypes\nctypes.memset(ctypes.addressof(ctypes.c_int()), 0, 4)", "sandbox: ctypes.memset is not allowed"),
        ("import ctypes\nctypes.c_int.from_address(id(1))", "sandbox: ctypes.cdata is not allowed"),
        ("import os\nos.kill(os.getppid(), 0)", "sandbox: signalling another process (os.kill) is not allowed"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "sandbox: resource.setrlimit is not allowed"),
        ("import os\nopen(f'/proc/{os.getppid()}/environ').read()", "sandbox: reading this file is not allowed"),
    ],
)
def test_bypasses_are_refused(code, message):
    result = run_python(code)
    assert result.exit_reason == "error"
    assert f"PermissionError: [Errno 13] {message}" in result.stderr


def test_threads_and_asyncio_still_work():
    code = (
        "import asyncio, threading\n"
        "out = []\n"
        "t = threading.Thread(target=out.append, args=(1,)); t.start(); t.join()\n"
        "async def main():\n"
        "    await asyncio.sleep(0)\n"
        "    return 2\n"
        "print(out[0] + asyncio.run(main()))"
    )
    assert run_python(code).stdout == "3\n"


def test_numpy_imports_under_the_limits():
    pytest.importorskip("numpy")
    result = run_python("import numpy as np\nprint(int(np.arange(10).sum()))", memory_mb=512)
    assert (result.exit_reason, result.stdout) == ("ok", "45\n")


def test_concurrent_runs_are_independent():
    results = [None] * 4

    def go(i):
        results[i] = run_python(f"import os, time\ntime.sleep(0.3)\nprint({i}, os.getcwd())")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 2.5  # in parallel, not one after another
    assert [r.stdout.split()[0] for r in results] == ["0", "1", "2", "3"]
    assert len({r.stdout.split()[1] for r in results}) == 4


# ---------------------------------------------------------------------------------- the tool


def test_as_text():
    assert SandboxResult("", "", "ok", 0, 0.1).as_text() == "(no output)"
    assert SandboxResult("out\n", "", "ok", 0, 0.1).as_text() == "out"
    assert SandboxResult("out\n", "warn\n", "ok", 0, 0.1).as_text() == "out\nwarn"
    assert SandboxResult("", "", "timeout", None, 3.0, detail="stopped").as_text() == "[timeout] stopped"


def test_python_tool_uses_the_default_limits(monkeypatch):
    assert python("print(1 + 1)") == "2"
    monkeypatch.setattr(sandbox, "DEFAULT_LIMITS", sandbox.SandboxLimits(max_output_chars=10))
    assert "[truncated" in python("print('b' * 100)")


def test_python_tool_schema():
    pytest.importorskip("transformers")
    from colocate.envs.tools import tool_schemas

    (schema,) = tool_schemas([python])
    assert schema["function"]["name"] == "python"
    assert schema["function"]["description"] == "Run Python code in a sandbox and return its output."
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "A complete Python program; print what you want to see."}},
        "required": ["code"],
    }


def test_bad_arguments_raise():
    with pytest.raises(TypeError):
        run_python(b"print(1)")
    with pytest.raises(ValueError):
        run_python("print(1)", timeout_s=0)


def test_a_sandboxed_program_dies_with_the_process_that_started_it():
    """A trainer killed outright (no cleanup) leaves no sandboxed program running."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, threading, time\n"
                f"sys.path.insert(0, {str(root)!r})\n"
                "from colocate.envs.sandbox import run_python\n"
                "threading.Thread(target=run_python, args=('import time\\ntime.sleep(60)',),"
                " kwargs={'timeout_s': 60}, daemon=True).start()\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    children: list[int] = []
    while not children and time.monotonic() < deadline:
        time.sleep(0.1)
        children = [int(d) for d in os.listdir("/proc") if d.isdigit() and _parent(int(d)) == starter.pid]
    assert children, "the sandbox did not start"
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 5
    while any(_running(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(c) for c in children)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
