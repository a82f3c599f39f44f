"""How colocate's command-line tools end on a user error: one line on stderr and exit status 2.

Decorate an entry point's `main(argv) -> int | None` with `entry_point`: a user error (a bad value,
a missing or unwritable file) prints `error: <message>` instead of a traceback; `--debug` on the
command line, or COLOCATE_DEBUG=1 in the environment, prints the traceback above that line.
Anything else (a bug) propagates with its traceback as usual.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Callable

DEBUG_FLAG = "--debug"
DEBUG_ENV = "COLOCATE_DEBUG"
DEBUG_HELP = f"On an error, {DEBUG_FLAG} (or {DEBUG_ENV}=1) also prints its traceback."
# ValueError: bad input; OSError (FileNotFoundError, PermissionError, a full disk...): the files.
USER_ERRORS = (ValueError, OSError)


def debug_requested(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def entry_point(main: Callable[[list[str]], int | None]) -> Callable[[list[str] | None], int]:
    """Wrap `main` so that user errors end as `error: ...` and status 2; `--debug` is removed from
    the arguments `main` sees. The wrapped function takes argv (default: sys.argv[1:])."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = debug_requested(args)
        try:
            code = main([a for a in args if a != DEBUG_FLAG])
        except USER_ERRORS as e:
            if debug:
                traceback.print_exc()
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0 if code is None else code

    return run
