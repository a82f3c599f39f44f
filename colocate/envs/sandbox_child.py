"""The sandbox's child: the bootstrap script that runs the policy's code in the sandboxed process.

`colocate/envs/sandbox.py` (the parent) starts `python -I -B -u -X utf8 sandbox_child.py CONFIG`, in a
fresh private directory, with CONFIG a JSON object: the directory ("dir"), the rlimits ("cpu_s",
"memory_mb", "file_mb"), whether to install the audit hook ("guard") and the credential paths it
refuses to read ("secrets"); `{"probe": true}` only reports the network isolation this machine
allows. The child moves itself into new user and network namespaces where it may, lowers its
rlimits, reads (and removes) the code the parent wrote to `CODE_FILE`, installs the audit hook and
runs the code as `__main__`; an uncaught exception is printed without this file's frames. What is
guaranteed and what is not is in the parent's docstring.

It runs under `python -I`, so it imports nothing outside the standard library; the parent imports
the constants below from it, so importing it does nothing else (`main` runs only as a script).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys

CODE_FILE = ".sandbox_code.py"
"""The user's code, written into the private directory by the parent; the child reads and removes it
before running it."""
TOOL_FILENAME = "<tool>"
"""The user's code's file name in tracebacks."""
MEMORY_EXIT_CODE = 213
"""The bootstrap's exit status when the user's code ended with an uncaught MemoryError."""
NOFILE = 128
"""RLIMIT_NOFILE: at most this many open files."""
NPROC = 64
"""RLIMIT_NPROC: at most this many processes/threads (set only in a user namespace of its own)."""


def _isolate_network() -> str:
    """Move this (single-threaded) process into new user and network namespaces, else a new network
    namespace only, else nothing; say which."""
    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    unshare = getattr(os, "unshare", None)
    if unshare is None:
        try:
            import ctypes

            libc_unshare = ctypes.CDLL(None, use_errno=True).unshare
        except (OSError, AttributeError):
            return "none"

        def unshare(flags: int) -> None:
            if libc_unshare(flags) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))

    try:
        unshare(clone_newuser | clone_newnet)
    except OSError:
        try:
            unshare(clone_newnet)
        except OSError:
            return "none"
        return "net"
    # No uid/gid map is written: unmapped, the capabilities the new namespace grants apply to no file
    # (with one, an id mapped to itself would get CAP_DAC_OVERRIDE over its files, a root trainer's
    # root-owned ones included); inside, the ids read as the overflow ids ("nobody").
    return "user+net"


def _set_limits(config: dict, userns: bool) -> None:
    import resource

    def lower(which: int, value: int, hard: int | None = None) -> None:
        old_soft, old_hard = resource.getrlimit(which)
        hard = value if hard is None else hard
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
        try:
            resource.setrlimit(which, (min(value, hard), hard))
        except (ValueError, OSError):
            pass

    lower(resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"] + 1)
    lower(resource.RLIMIT_AS, config["memory_mb"] * 2**20)
    lower(resource.RLIMIT_FSIZE, config["file_mb"] * 2**20)
    lower(resource.RLIMIT_CORE, 0)
    lower(resource.RLIMIT_NOFILE, NOFILE)
    if userns:
        lower(resource.RLIMIT_NPROC, NPROC)


_NETWORK_EVENTS = frozenset(
    {
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "socket.getnameinfo",
        "socket.sethostname",
        "urllib.Request",
        "http.client.connect",
        "ftplib.connect",
        "smtplib.connect",
        "poplib.connect",
        "imaplib.open",
        "nntplib.connect",
        "telnetlib.Telnet.open",
        "webbrowser.open",
    }
)
_PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
        "os.startfile",
    }
)
_NATIVE_EVENTS = frozenset(
    {
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.call_function",
        "ctypes.cdata",
        "ctypes.PyObj_FromPtr",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "sqlite3.enable_load_extension",
        "sqlite3.load_extension",
        "resource.setrlimit",
    }
)
_WRITE_EVENTS = {  # event -> (index of a path argument, index of its dir_fd argument or None, follow a final symlink)
    "os.remove": ((0, 1, False),),
    "os.rmdir": ((0, 1, False),),
    "os.mkdir": ((0, 2, False),),
    "os.rename": ((0, 2, False), (1, 3, False)),
    "os.link": ((0, 2, False), (1, 3, False)),
    "os.symlink": ((1, 2, False),),
    "os.chmod": ((0, 2, True),),
    "os.chown": ((0, 3, True),),
    "os.utime": ((0, 3, True),),
    "os.truncate": ((0, None, True),),
    "os.chflags": ((0, None, True),),
    "os.lchflags": ((0, None, False),),
    "os.setxattr": ((0, None, True),),
    "os.removexattr": ((0, None, True),),
    "shutil.rmtree": ((0, None, False),),
    "shutil.copyfile": ((1, None, True),),
    "shutil.copymode": ((1, None, True),),
    "shutil.copystat": ((1, None, True),),
    "shutil.copytree": ((1, None, True),),
    "shutil.chown": ((0, None, True),),
    "shutil.move": ((0, None, False), (1, None, True)),
    "shutil.make_archive": ((0, None, True),),
    "shutil.unpack_archive": ((1, None, True),),
    "sqlite3.connect": ((0, None, True),),
}
_WRITABLE_ANYWHERE = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/proc/self/fd/1", "/proc/self/fd/2"})


def _install_guard(root: str, secrets: list[str]) -> None:
    """The audit hook (see the docstring of colocate/envs/sandbox.py): PermissionError for the events it refuses."""
    fspath, fsdecode, getcwd, readlink, getpid = os.fspath, os.fsdecode, os.getcwd, os.readlink, os.getpid
    realpath, join, isabs, split = os.path.realpath, os.path.join, os.path.isabs, os.path.split
    root = realpath(root)
    root_prefix = root.rstrip("/") + "/"
    secrets = tuple(secrets)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    network, processes, native, writes = _NETWORK_EVENTS, _PROCESS_EVENTS, _NATIVE_EVENTS, _WRITE_EVENTS

    def refuse(what: str, path: str | None = None):
        if path is None:
            return PermissionError(errno.EACCES, f"sandbox: {what} is not allowed")
        return PermissionError(errno.EACCES, f"sandbox: {what} is not allowed", path)

    def resolve(path, dir_fd, follow: bool) -> str | None:
        """The absolute path meant, symlinks resolved (all but a final one unless `follow`); None for
        an open file descriptor."""
        if path is None or isinstance(path, int):
            return None
        path = fsdecode(fspath(path))
        if not isabs(path):
            base = readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else getcwd()
            path = join(base, path)
        if path in _WRITABLE_ANYWHERE:
            return path
        if follow:
            return realpath(path)
        head, tail = split(path.rstrip("/") or "/")
        return realpath(path) if tail in ("", ".", "..") else join(realpath(head), tail)

    def writable(path: str | None) -> bool:
        return path is None or path == root or path.startswith(root_prefix) or path in _WRITABLE_ANYWHERE

    def readable(path: str | None) -> bool:
        if path is None:
            return True
        if path.startswith("/proc/"):
            pid = path[6:].split("/", 1)[0]
            if pid.isdigit() and int(pid) != getpid():
                return False
        return not any(path == s or path.startswith(s + "/") for s in secrets)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            resolved = resolve(path, None, True)
            if writing and not writable(resolved):
                raise refuse("writing outside the working directory", resolved)
            if not readable(resolved):
                raise refuse("reading this file", resolved)
        elif event in writes:
            for index, fd_index, follow in writes[event]:
                if index < len(args):
                    dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                    resolved = resolve(args[index], dir_fd, follow)
                    if not writable(resolved):
                        raise refuse(f"changing files outside the working directory ({event})", resolved)
        elif event in network:
            raise refuse(f"network access ({event})")
        elif event in processes:
            raise refuse(f"starting a process ({event})")
        elif event in native:
            raise refuse(f"{event}")
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, getpid()):
                raise refuse(f"signalling another process ({event})")
        elif event == "resource.prlimit":
            if len(args) > 2 and args[2] is not None:
                raise refuse("resource.prlimit")

    sys.addaudithook(hook)

    # ctypes' ready-made raw-memory writers run no audit event of their own (Python 3.11).
    import ctypes

    def blocked(name: str):
        def refused(*args, **kwargs):
            raise refuse(f"ctypes.{name}")

        return refused

    ctypes.memmove, ctypes.memset = blocked("memmove"), blocked("memset")


def _print_exception(e: BaseException) -> None:
    """The traceback of `e` without the bootstrap's frames (this file's)."""
    import traceback

    here = os.path.realpath(__file__)

    def trim(te: traceback.TracebackException | None, seen: set[int]) -> None:
        if te is None or id(te) in seen:
            return
        seen.add(id(te))
        kept = [f for f in te.stack if os.path.realpath(f.filename) != here]
        te.stack = traceback.StackSummary.from_list(kept)
        trim(te.__cause__, seen)
        trim(te.__context__, seen)

    te = traceback.TracebackException(type(e), e, e.__traceback__, compact=True)
    trim(te, set())
    sys.stderr.write("".join(te.format()))
    sys.stderr.flush()


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the process that started it dies (a trainer that crashed or was
    killed leaves no sandboxed program running), and exit now if it is gone already."""
    if parent is None:
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's kill of the process group remains
        return
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    _die_with_parent(config.get("parent"))
    if config.get("probe"):
        print(_isolate_network())
        return 0
    network = _isolate_network()
    import ctypes  # noqa: F401  (imported before the guard: a later `import ctypes` would need dlopen)
    import linecache
    import traceback
    import types

    _set_limits(config, userns=network == "user+net")
    root = config["dir"]
    code_path = os.path.join(root, CODE_FILE)
    with open(code_path, encoding="utf-8", errors="surrogatepass") as f:
        code = f.read()
    os.remove(code_path)

    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    boot_module = sys.modules["__main__"]  # noqa: F841  (keeps this module's globals alive)
    sys.modules["__main__"] = main
    sys.argv = [TOOL_FILENAME]
    sys.path.insert(0, root)
    sys.dont_write_bytecode = True
    linecache.cache[TOOL_FILENAME] = (len(code), None, code.splitlines(True), TOOL_FILENAME)
    try:
        compiled = compile(code, TOOL_FILENAME, "exec")
    except (SyntaxError, ValueError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        return 1
    if config.get("guard", True):
        _install_guard(root, config.get("secrets", []))
    try:
        exec(compiled, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (the user's code's exception, shown as Python would)
        memory = isinstance(e, MemoryError)
        try:
            _print_exception(e)
        except Exception:  # noqa: BLE001
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
        return MEMORY_EXIT_CODE if memory else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
