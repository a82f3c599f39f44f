"""Run a test function on N ranks (gloo on CPU, NCCL on GPUs) in spawned processes, which meet
through a file store: no TCP port, which another process could take between being found free and
being bound."""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import traceback

import torch.distributed
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, store_path, fn, args, errors):
    faulthandler.enable(all_threads=True)  # a rank that aborts prints every thread's Python stack
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from colocate import dist

    finished = False
    try:
        dist.init(timeout_minutes=2, store=torch.distributed.FileStore(store_path, world_size))
        fn(rank, world_size, *args)
        finished = True
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy(synchronize=finished)
    dist.exit_process(0)


def run_ranks(fn, world_size: int, *args):
    """Call fn(rank, world_size, *args) on every rank; re-raise the first rank's failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, os.path.join(store_dir, "store"), fn, args, errors))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
    failed = [p for p in procs if p.exitcode != 0]
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
        raise AssertionError(errors.get() if not errors.empty() else f"exit codes {[p.exitcode for p in procs]}")
