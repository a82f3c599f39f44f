"""Run a test function on N gloo ranks (CPU) in spawned processes."""

from __future__ import annotations

import faulthandler
import os
import traceback

import torch.multiprocessing as mp

from colocate.dist import free_port


def _worker(rank, world_size, port, fn, args, errors):
    faulthandler.enable(all_threads=True)  # a rank that aborts prints every thread's Python stack
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from colocate import dist

    finished = False
    try:
        dist.init(timeout_minutes=2)
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
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
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
