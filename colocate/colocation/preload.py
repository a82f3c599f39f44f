"""`python -m colocate.colocation.preload CONFIG [FLAGS...]` prints the torch_memory_saver hook
library to put in LD_PRELOAD for this run, or nothing.

The native engine needs the preload hook so that its CUDA-graph memory can be paused too; the SGLang
backend preloads the hook into its own scheduler process and refuses a second copy, so it gets none.
"""

from __future__ import annotations

import os
import sys


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


def main(argv: list[str] | None = None) -> int:
    import torch

    from colocate.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load_config(["--config", argv[0], *argv[1:]])
    if cfg.rollout.engine != "native" or not torch.cuda.is_available():
        return 0
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return 0
    path = preload_library()
    if path:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
