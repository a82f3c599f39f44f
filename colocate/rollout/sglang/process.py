"""What the SGLang engine does to the process that hosts it, and how we undo it.

SGLang's offline `Engine` was written to own its process: constructing it rewrites the root
logging config, installs SIGQUIT (and, on the first request, SIGTERM) handlers that kill the whole
process tree, forces the multiprocessing start method to "spawn", writes NCCL_/CUDA_ and other
environment variables, and its `shutdown()` SIGKILLs every child of the process — DataLoader
workers included. Inside a torchrun rank that also trains, each of these is a bug. This module
holds the pieces the adapter uses to snapshot that state before the engine exists and put it
back afterwards, to pick per-rank ports and the device index, to check the allocator settings
the memory saver cannot live with, and to kill exactly the engine's own process trees.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from colocate.rollout.sglang.api import CUDA_GRAPH_ENV

DEFAULT_BASE_PORT = 30000
"""First port of rank 0. Below Linux's ephemeral range (32768+) and clear of torchrun's 29500."""
PORT_STRIDE = 8
"""Ports reserved per local rank: `port` is base + stride * local_rank, `nccl_port` the next one."""
SIGNALS = (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT)
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
MEMORY_SAVER_LIBRARY = "torch_memory_saver"
KILL_TIMEOUT_S = 60.0


def visible_device_index(local_rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """Index of this rank's GPU among the devices it can see (what SGLang's `base_gpu_id` means).

    The scheduler inherits CUDA_VISIBLE_DEVICES and calls set_device(base_gpu_id), so a physical
    id is wrong whenever the launcher narrowed the visible set: a rank that sees one GPU uses 0,
    a rank that sees them all uses its LOCAL_RANK.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank
    devices = [d for d in visible.split(",") if d.strip()]
    if not devices:
        raise ValueError("CUDA_VISIBLE_DEVICES is empty: this rank sees no GPU for the SGLang engine")
    if len(devices) == 1:
        return 0
    if local_rank >= len(devices):
        raise ValueError(f"local_rank={local_rank} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(devices)} devices")
    return local_rank


def engine_ports(local_rank: int, base_port: int = DEFAULT_BASE_PORT) -> tuple[int, int]:
    """(port, nccl_port) for this rank: distinct across the ranks of one host by construction.

    Left to itself SGLang draws nccl_port from the global `random`, which every rank seeds the
    same way, so eight engines on one box race for one port.
    """
    port = base_port + PORT_STRIDE * local_rank
    if base_port < 1024 or port + 1 > 65535:
        raise ValueError(f"base_port={base_port} gives ports outside 1024..65535 for local_rank={local_rank}")
    return port, port + 1


def check_ports_free(ports: Iterable[int]) -> None:
    """Bind each port once; a port already taken is reported before any engine process starts."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                raise RuntimeError(
                    f"port {port} for the SGLang engine is in use ({e}); pass another base_port "
                    f"(each local rank uses base_port + {PORT_STRIDE} * local_rank and the next port)"
                ) from e


def check_allocator_env(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse expandable segments: the memory saver cannot pause them, and tensors in them cannot
    be exported over CUDA IPC, which is how our weights reach the scheduler."""
    for var in ALLOCATOR_ENV:
        for option in environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                raise ValueError(
                    f"{var}={environ[var]!r}: expandable_segments:True cannot be used with the SGLang "
                    "rollout engine (torch_memory_saver refuses it and its buffers cannot be shared "
                    "over CUDA IPC); remove it from the environment"
                )


def child_env(environ: Mapping[str, str], release_cuda_graph: bool) -> dict[str, str | None]:
    """Environment changes for the engine's processes while they are spawned (None = unset).

    SGLang puts its own torch_memory_saver hook into the scheduler's LD_PRELOAD and the hook
    asserts it is there once, so a copy inherited from our launcher is dropped for the child;
    our own process keeps the library it already loaded. Graph memory is only pausable when the
    scheduler starts with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1.
    """
    changes: dict[str, str | None] = {}
    preload = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    kept = [p for p in preload if MEMORY_SAVER_LIBRARY not in Path(p).name]
    if len(kept) != len(preload):
        changes["LD_PRELOAD"] = ":".join(kept) or None
    if release_cuda_graph:
        changes[CUDA_GRAPH_ENV] = "1"
    return changes


@dataclass
class ProcessState:
    """Snapshot of what the engine changes in our process: environment, root logging, signal
    handlers, multiprocessing start method. `restore()` puts it back and may run more than once
    (after construction, then at shutdown); environment keys are restored only for the names
    that differed at the first restore, so later changes by the trainer survive shutdown."""

    environ: dict[str, str]
    root_level: int
    root_handlers: list[logging.Handler]
    signal_handlers: dict[int, object]
    start_method: str | None
    _env_keys: set[str] | None = field(default=None, repr=False)

    @classmethod
    def capture(cls) -> "ProcessState":
        root = logging.getLogger()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.getsignal(s) for s in SIGNALS}
        return cls(
            environ=dict(os.environ),
            root_level=root.level,
            root_handlers=list(root.handlers),
            # getsignal() is None for a handler installed outside Python; that one cannot be put back.
            signal_handlers={s: h for s, h in handlers.items() if h is not None},
            start_method=multiprocessing.get_start_method(allow_none=True),
        )

    def restore(self) -> None:
        if self._env_keys is None:
            self._env_keys = {k for k in set(os.environ) | set(self.environ) if os.environ.get(k) != self.environ.get(k)}
        for key in self._env_keys:
            if key in self.environ:
                os.environ[key] = self.environ[key]
            else:
                os.environ.pop(key, None)
        root = logging.getLogger()
        for handler in root.handlers:
            if handler not in self.root_handlers:
                handler.close()
        root.handlers[:] = self.root_handlers
        root.setLevel(self.root_level)
        for sig, handler in self.signal_handlers.items():
            signal.signal(sig, handler)
        multiprocessing.set_start_method(self.start_method, force=True)


@contextmanager
def engine_process_guard(state: ProcessState, env_changes: Mapping[str, str | None]) -> Iterator[None]:
    """Run engine construction with `env_changes` applied and our root handlers detached, then
    restore `state` whatever happens.

    Detaching matters because SGLang calls `logging.basicConfig(force=True)`, which closes every
    handler on the root logger; a closed FileHandler would not log again once put back.
    """
    logging.getLogger().handlers[:] = []
    for key, value in env_changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        state.restore()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, found by walking parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")


def kill_process_trees(pids: Iterable[int], timeout_s: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL each of our child processes in `pids` and all their descendants; wait until they
    are gone. Pids that are not our children (already reaped, perhaps reused) are left alone."""
    me = os.getpid()
    roots = [p for p in pids if (s := _stat(p)) is not None and s[1] == me]
    # Collect the whole trees first: once a parent dies its children are re-parented and lost.
    victims = [v for root in roots for v in [root, *descendants(root)]]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while True:
        # multiprocessing reaps the Process objects it started; we reap only the other children,
        # so that a Process object never loses its exit status to us.
        running = {p.pid for p in multiprocessing.active_children()}
        for pid in roots:
            if pid not in running and (s := _stat(pid)) is not None and s[0] == "Z" and s[1] == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        alive = [p for p in victims if not _gone(p)]
        if not alive:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang engine processes {alive} survived SIGKILL for {timeout_s:.0f} s")
        time.sleep(0.01)
