"""`python -m colocate.memory_saver [--gpus] CONFIG [FLAGS...]` prints the torch_memory_saver hook
library to put in LD_PRELOAD for this run, or an empty line; with `--gpus`, the number of CUDA
devices torch sees first, on a line of its own (launch.sh asks both in one process: importing torch
takes seconds on a GPU machine). `handle()` is the library's handle in the mode this process can use.

`python -m colocate.memory_saver --world-size N CONFIG [FLAGS...]` checks, without importing torch,
that the run's batch sizes divide among N processes, and ends a bad config or world size in one
line, `error: ...`, with exit status 2: launch.sh asks before torchrun, whose failure report would
bury each rank's own error line.

The native engine needs the preload hook so that its CUDA-graph memory can be paused too; the SGLang
backend preloads the hook into its own scheduler process and refuses a second copy, so it gets none.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys

from colocate.cli import entry_point


def preload_active() -> bool:
    """The hook library was preloaded into this process (LD_PRELOAD at start)."""
    return any("torch_memory_saver" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


@functools.cache
def handle():
    """torch_memory_saver in preload mode when its hook was preloaded, else in its in-process
    ("torch") hook mode, whose pools are freed at exit by `_free_pools_at_exit`."""
    from torch_memory_saver import torch_memory_saver as saver

    if getattr(saver, "_impl", None) is None:
        saver.hook_mode = "preload" if preload_active() else "torch"
    if not preload_active():
        atexit.register(_free_pools_at_exit, saver)
    return saver


def _free_pools_at_exit(saver) -> None:
    """Free the torch-hook mode's memory pools while the CUDA runtime is still up.

    In this mode torch_memory_saver 0.0.10 frees pool memory only while its thread-local
    "interesting region" flag is set, and otherwise ends the process with exit status 1. Its pools
    are destroyed at interpreter exit, outside any region, so a process that allocated in a region
    ends with status 1 after its work is done. Here the flag is set for the rest of the
    process (nothing allocates after this), and the pools are dropped now, as the library itself
    does at exit on ROCm and XPU; tensors still alive free their blocks later, with the flag set.
    Entering a region instead would hold the pool in use, which makes MemPool's destructor abort.
    Uses the library's private handles; does nothing if they are not there (another version, or
    the saver never used)."""
    impl = getattr(saver, "_impl", None)
    wrapper = getattr(impl, "_binary_wrapper", None)
    if getattr(impl, "_hook_mode", None) != "torch" or wrapper is None or not hasattr(impl, "_mem_pools"):
        return
    wrapper.cdll.tms_set_interesting_region(True)
    impl._mem_pools.clear()


def preload_library() -> str | None:
    """The hook library of the installed torch_memory_saver, or None when it is not installed."""
    try:
        from torch_memory_saver.utils import get_binary_path_from_package
    except ImportError:
        return None
    try:
        return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except RuntimeError:
        return None


def with_preload(env: dict[str, str]) -> dict[str, str]:
    """A copy of the environment `env` with the hook library first in LD_PRELOAD (when installed),
    for a child process whose native engine should have pausable graph memory."""
    env = dict(env)
    library = preload_library()
    if library and "torch_memory_saver" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    return env


@entry_point
def check_world_size(argv: list[str]) -> None:
    """`N CONFIG [FLAGS...]`: the config loads, and its batch sizes divide among N processes."""
    from colocate.config_loading import load_config

    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        raise ValueError(f"--world-size needs a process count and a config file, got {argv[:2]}")
    if {"-h", "--help"} & set(argv[2:]):
        return  # the run prints the help
    load_config(["--config", argv[1], *argv[2:]]).check_world_size(int(argv[0]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--world-size":
        return check_world_size(argv[1:])
    import torch

    from colocate.config_loading import load_config

    gpus = bool(argv) and argv[0] == "--gpus"
    argv = argv[1:] if gpus else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load_config(["--config", argv[0], *argv[1:]])
    count = torch.cuda.device_count()
    if gpus:
        print(count)
    wanted = cfg.rollout.engine == "native" and count > 0 and not preload_active()
    print((preload_library() or "") if wanted else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
