"""The built-in `python` tool: model-written code run in a sandboxed subprocess.

`run_python(code, ...)` runs `code` as `__main__` in a fresh Python process (this interpreter,
`python -I -B -u`, with sandbox_child.py as its bootstrap) and returns a `SandboxResult`: stdout, stderr, why
it ended and how long it took; `SandboxResult.as_text()` is the observation the policy reads.
`python(code)` is the tool the environments offer the policy: `run_python` with `DEFAULT_LIMITS`.

What is guaranteed (on Linux):

- Wall clock: at `timeout_s` the whole process group is killed (SIGKILL; the child leads a session of
  its own), so a sleeping or hung program ends on time, and the caller's thread with it.
- CPU time: RLIMIT_CPU (soft at `cpu_s` rounded up to whole seconds: SIGXCPU; hard one second later:
  SIGKILL). Address space: RLIMIT_AS at `memory_mb` (an allocation past it fails: MemoryError, or a
  crash in native code). File size: RLIMIT_FSIZE at `file_mb` per file (a write past it fails with
  EFBIG). Core dumps off; at most 128 open files; at most 64 processes/threads where the sandbox got a
  user namespace of its own (RLIMIT_NPROC counts per user and namespace, so outside one it would count
  the trainer's threads too, and it is left alone). The limits are set by the child itself before the
  user's code runs, not in a `preexec_fn`: that would make `subprocess` fork the whole (multi-GB,
  multi-threaded) trainer instead of vfork-exec, which is slow and not thread-safe.
- Output: stdout and stderr are read as they come, each kept to `max_output_chars` (its head and its
  tail, with a "... [truncated N chars] ..." line between); a program that prints more than
  `OUTPUT_KILL_BYTES` in all is killed ("output_limit"), so the caller's memory stays bounded.
- Files: a fresh private temporary directory is the cwd, HOME and TMPDIR, and is removed afterwards,
  whatever the program did to it. The environment is stripped to a few variables (no tokens, no
  CUDA_VISIBLE_DEVICES: the GPUs are hidden); stdin is /dev/null.
- Network: the child first moves itself into new user and network namespaces (`unshare`, through
  libc on Python < 3.12); a fresh network namespace has no interface up, not even loopback, so no
  IP socket can reach anything, whatever the code does (Unix sockets on the filesystem still can:
  only the audit hook refuses their connect). Containers and hardened kernels often refuse
  unprivileged namespaces; then a network namespace alone is tried (enough for a root trainer), and
  failing that the step is skipped silently (`network_isolation()` says which happened on this
  machine). In the user namespace no id is mapped, so the code runs as "nobody" there and the
  namespace's capabilities apply to no file: a root trainer's sandbox loses root's file privileges.

What is NOT guaranteed: in the child, before the user's code runs, an audit hook (`sys.addaudithook`)
refuses, with PermissionError: network calls (connect, bind, sendto, name lookups), writes outside
the private directory (open for writing, rename, remove, mkdir, symlink, chmod, rmtree, ...), new
processes (subprocess, os.system, exec, posix_spawn, fork), signals to other processes, raising
rlimits, reading other processes' /proc entries and a few well-known credential files, and the
ctypes calls that would let code step around the hook. Reading files elsewhere stays allowed (the
standard library and site-packages must import). This hook is a guard against the accidents of a
model's code (an `rm -rf`-like cleanup, a download, a `pip install`), not a security boundary: code
that sets out to escape can (C extensions, cffi, `_posixsubprocess`, ctypes pointers made from
integers, gc tricks on the hook's state).
The namespaces and rlimits are the kernel-enforced part; run the trainer itself in a container or VM
if the policy's code must be treated as hostile.

This file is the parent's side: it writes the code into the private directory, starts the child,
reads its output, enforces the wall clock and the output cap and says how it ended. The child's side
(namespaces, rlimits, the audit hook, running the code) is colocate/envs/sandbox_child.py, the
bootstrap script the child runs; the constants both sides share live there.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache

from colocate.envs import sandbox_child
from colocate.envs.sandbox_child import CODE_FILE, MEMORY_EXIT_CODE

__all__ = ["DEFAULT_LIMITS", "EXIT_REASONS", "SandboxLimits", "SandboxResult", "network_isolation", "python", "run_python"]

EXIT_REASONS = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit")

OUTPUT_KILL_BYTES = 8 * 1024 * 1024
"""A program that writes more than this to stdout and stderr together is killed ("output_limit"):
what is kept is `max_output_chars` per stream anyway, and reading on costs the caller time."""

_CHILD_SCRIPT = os.path.abspath(sandbox_child.__file__)
"""The child's bootstrap script (absolute: the child's cwd is elsewhere)."""
_CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",  # one thread per BLAS/OpenMP pool: a 100-core host's pools would not fit RLIMIT_AS
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MB of address space per thread arena
    "CUDA_VISIBLE_DEVICES": "",
    "MPLBACKEND": "Agg",
}
_SECRET_PATHS = (
    "~/.ssh",
    "~/.netrc",
    "~/.git-credentials",
    "~/.aws",
    "~/.config/gcloud",
    "~/.docker/config.json",
    "~/.pypirc",
    "~/.kaggle",
    "~/.cache/huggingface/token",
    "~/.huggingface/token",
)
"""The trainer's credential files that the policy's code may not even read (paths in the trainer's HOME)."""


# ------------------------------------------------------------------------------------------ API


@dataclass(frozen=True)
class SandboxLimits:
    """The limits `python` runs with; replace `DEFAULT_LIMITS` to change them for every call."""

    timeout_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    max_output_chars: int = 4096
    file_mb: int = 64


DEFAULT_LIMITS = SandboxLimits()


@dataclass
class SandboxResult:
    """How one run of the policy's code went."""

    stdout: str
    """What the program printed (cut to `max_output_chars`, with a marker where it was cut)."""
    stderr: str
    """Its stderr: a traceback (of the user's frames only) when it raised."""
    exit_reason: str
    """One of EXIT_REASONS: "ok" (exit status 0), "error" (an uncaught exception, a non-zero exit
    status, a crash), "timeout" (killed at the wall-clock limit), "cpu_limit", "memory_limit",
    "output_limit" (killed for printing more than OUTPUT_KILL_BYTES)."""
    exit_code: int | None
    """The process's exit status (negative: the signal that killed it); None when the sandbox killed
    it (timeout, output_limit) or it never started."""
    seconds: float
    """Wall-clock time from start to exit."""
    cpu_seconds: float = 0.0
    """User plus system CPU time of the process."""
    truncated_chars: int = 0
    """Characters of stdout and stderr left out."""
    detail: str = ""
    """A sentence on why it ended (for the line `as_text` adds when `exit_reason` is not "ok")."""

    def as_text(self) -> str:
        """The observation the policy sees: stdout, then stderr, then a line naming the exit reason
        when it is not "ok"; "(no output)" when there is nothing to show."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text.strip()]
        if self.exit_reason != "ok":
            parts.append(f"[{self.exit_reason}] {self.detail}".rstrip())
        return "\n".join(parts) if parts else "(no output)"


def python(code: str) -> str:
    """Run Python code in a sandbox and return its output.

    Args:
        code: A complete Python program; print what you want to see.
    """
    return run_python(code, **asdict(DEFAULT_LIMITS)).as_text()


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    cpu_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_chars: int = 4096,
    file_mb: int = 64,
) -> SandboxResult:
    """Run `code` as `__main__` in a sandboxed Python process (see the module docstring) and return
    how it went. Blocks for at most about `timeout_s` (plus the time to kill and clean up); never
    raises for anything the code does. Thread-safe: each call has its own process and directory."""
    return _run(
        code,
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_output_chars=max_output_chars,
        file_mb=file_mb,
        guard=True,
    )


@lru_cache(maxsize=1)
def network_isolation() -> str:
    """What the child gets on this machine (probed once): "user+net" (new user and network
    namespaces), "net" (a new network namespace only: the trainer runs as root outside a user
    namespace of its own), or "none" (the kernel or container refused; only the audit hook stands
    between the code and the network)."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-B", _CHILD_SCRIPT, json.dumps({"probe": True})],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(_CHILD_ENV),
        )
    except (OSError, subprocess.SubprocessError):
        return "none"
    mode = done.stdout.strip()
    return mode if mode in ("user+net", "net") else "none"


# ------------------------------------------------------------------------------------- the parent


def _run(
    code: str, *, timeout_s: float, cpu_s: float, memory_mb: int, max_output_chars: int, file_mb: int, guard: bool
) -> SandboxResult:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if timeout_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or file_mb <= 0 or max_output_chars < 0:
        raise ValueError("timeout_s, cpu_s, memory_mb and file_mb must be positive, max_output_chars not negative")
    cpu_limit = max(1, math.ceil(cpu_s))
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="colocate-sandbox-"))
    start = time.monotonic()
    proc = None
    try:
        with open(os.path.join(workdir, CODE_FILE), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        config = {
            "dir": workdir,
            "cpu_s": cpu_limit,
            "memory_mb": int(memory_mb),
            "file_mb": int(file_mb),
            "guard": guard,
            "parent": os.getpid(),
            "secrets": [os.path.realpath(p) for p in map(os.path.expanduser, _SECRET_PATHS) if os.path.isabs(p)],
        }
        env = {**_CHILD_ENV, "HOME": workdir, "TMPDIR": workdir, "TMP": workdir, "TEMP": workdir, "MPLCONFIGDIR": workdir}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-u", "-X", "utf8", _CHILD_SCRIPT, json.dumps(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            return SandboxResult(
                "",
                f"sandbox: could not start Python: {e}",
                "error",
                None,
                time.monotonic() - start,
                detail="the sandbox could not start",
            )
        deadline = start + timeout_s
        streams = {proc.stdout.fileno(): _Capture(max_output_chars), proc.stderr.fileno(): _Capture(max_output_chars)}
        stopped = _pump(streams, deadline, OUTPUT_KILL_BYTES)
        if stopped is None and not _exited(proc.pid, deadline):
            stopped = "timeout"  # it closed its stdout and stderr, but runs on
        if stopped is not None:
            _kill_group(proc.pid)
            _pump(streams, time.monotonic() + 1.0, None)  # what was written before the kill
        _kill_group(proc.pid)  # anything left in its group; the leader is not reaped yet, so its id is not reused
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_seconds = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # reaped already (SIGCHLD ignored): the status is lost, as Popen.wait takes it
            proc.returncode, cpu_seconds = 0, 0.0
        seconds = time.monotonic() - start
        (stdout, cut_out), (stderr, cut_err) = (cap.text() for cap in streams.values())
        reason, exit_code, detail = _classify(
            proc.returncode, stopped, cpu_seconds, cpu_limit, timeout_s=timeout_s, memory_mb=memory_mb
        )
        return SandboxResult(stdout, stderr, reason, exit_code, seconds, cpu_seconds, cut_out + cut_err, detail)
    finally:
        if proc is not None:
            if proc.returncode is None:  # something above raised: leave nothing behind
                _kill_group(proc.pid)
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
        _remove_tree(workdir)


def _classify(
    rc: int, stopped: str | None, cpu_seconds: float, cpu_limit: int, *, timeout_s: float, memory_mb: int
) -> tuple[str, int | None, str]:
    """(exit_reason, exit_code, detail) of a finished run."""
    if stopped == "timeout":
        return "timeout", None, f"stopped at the wall-clock limit of {timeout_s:g} s"
    if stopped == "output_limit":
        return "output_limit", None, f"stopped after printing more than {OUTPUT_KILL_BYTES} bytes"
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu_seconds >= cpu_limit - 0.05):
        return "cpu_limit", rc, f"stopped at the CPU time limit of {cpu_limit} s"
    if rc == MEMORY_EXIT_CODE:
        return "memory_limit", rc, f"out of memory (limit {memory_mb} MB)"
    if rc == -signal.SIGKILL:  # not by us, nor for CPU time: the kernel's OOM killer
        return "memory_limit", rc, "killed (SIGKILL), probably out of memory"
    if rc == 0:
        return "ok", 0, ""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return "error", rc, f"killed by {name}"
    return "error", rc, f"exit code {rc}"


class _Capture:
    """One output stream, decoded as it comes; keeps its first and last `limit // 2` characters."""

    def __init__(self, limit: int):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.head_limit, self.tail_limit = limit - limit // 2, limit // 2
        self.head: list[str] = []
        self.head_len = 0
        self.tail = ""
        self.total = 0
        self.finished = False

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        self.total += len(text)
        if self.head_len < self.head_limit and text:
            taken = text[: self.head_limit - self.head_len]
            self.head.append(taken)
            self.head_len += len(taken)
            text = text[len(taken) :]
        if text and self.tail_limit:
            self.tail = (self.tail + text)[-self.tail_limit :]

    def text(self) -> tuple[str, int]:
        """(the text kept, how many characters were left out)."""
        if not self.finished:
            self.feed(b"", final=True)
            self.finished = True
        head = "".join(self.head)
        cut = self.total - len(head) - len(self.tail)
        if cut <= 0:
            return head + self.tail, 0
        return f"{head}\n... [truncated {cut} chars] ...\n{self.tail}", cut


def _pump(streams: dict[int, _Capture], deadline: float, kill_bytes: int | None) -> str | None:
    """Read the child's pipes until both close (None), the deadline ("timeout") or more than
    `kill_bytes` in all ("output_limit")."""
    total = 0
    with selectors.DefaultSelector() as selector:
        for fd, capture in streams.items():
            if not capture.finished:
                selector.register(fd, selectors.EVENT_READ, capture)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    key.data.feed(b"", final=True)
                    key.data.finished = True
                    continue
                key.data.feed(data)
                total += len(data)
                if kill_bytes is not None and total > kill_bytes:
                    return "output_limit"
    return None


def _exited(pid: int, deadline: float) -> bool:
    """Wait (without reaping it) until `pid` has exited: True, or the deadline passed: False."""
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already (SIGCHLD ignored in this process)
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.05)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    """Remove the private directory, even where the program took away permissions."""

    def retry(function, failed_path, _exc_info):
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            if os.path.isdir(failed_path) and not os.path.islink(failed_path):
                os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)
