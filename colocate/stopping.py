"""Clean stops: SIGINT (Ctrl-C) and SIGTERM end a run at the next safe point, after a checkpoint.

`StopSignals.install()` replaces Python's KeyboardInterrupt (which would unwind every rank from
wherever it was, mid-collective, with a traceback per rank) by a flag. The loop asks `requested()`
at its safe points, after a step's training and before the next step begins; every rank agrees on
the answer, so all ranks stop at the same step even when the signal reached only one. The step in
flight finishes its generation and training, the run saves a checkpoint (checkpoint.save_on_exit),
prints its summary and exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM; 0
under torchrun, see below).

A second SIGINT exits at once without saving.

Under torchrun a clean stop exits 0, so that torchrun does not print its failure report over the
stop's one line; the launcher (launch.sh), which forwards the signal to the ranks, exits 130 or 143.
"""

from __future__ import annotations

import os
import signal
import sys

from colocate import dist


class StopSignals:
    def __init__(self, is_main: bool = True):
        self.is_main = is_main
        self.signum: int | None = None
        """The signal that asked for a stop (None: none yet)."""
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._say(
                f"{signal.Signals(signum).name}: stopping after the step in flight, then saving a "
                "checkpoint (Ctrl-C again to exit at once, without saving)"
            )
        elif signum == signal.SIGINT:
            self._say("second SIGINT: exiting at once, without saving the step in flight")
            os._exit(128 + signum)

    def requested(self, device=None) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same point)."""
        return bool(dist.all_reduce_max(int(self.signum is not None), device))

    def agreed_signum(self, device=None) -> int:
        """The stopping signal, the same on every rank (SIGTERM where ranks saw different ones)."""
        return dist.all_reduce_max(self.signum or 0, device) or signal.SIGTERM

    def _say(self, message: str) -> None:
        if self.is_main:
            print(f"[colocate] {message}", file=sys.stderr, flush=True)


def exit_code(signum: int) -> int:
    """128 + the signal's number, or 0 under torchrun (see the module docstring)."""
    return 0 if "TORCHELASTIC_RUN_ID" in os.environ else 128 + signum
