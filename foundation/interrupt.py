"""Stopping a run on SIGTERM or SIGINT (Ctrl-C, `kill`, `scancel` of a local job) so that it says so and can resume.
SIGUSR1 stops it the same way: srun turns a SIGTERM into killing its tasks at once, and forwards SIGUSR1 as it is,
so the launcher stops ranks under srun with it (jobs/ranks.py).

`stop_signals()` (around a job, in the main thread) turns either signal into `Interrupted`, a BaseException like
KeyboardInterrupt, so the job's `summary.json` says `interrupted`. Inside `checkpoint_at_step_end()` (a training loop
that checkpoints), the first signal is only recorded: the loop sees `stop_requested()` at the end of its step, writes
a checkpoint and raises `Interrupted` itself; a second signal raises at once. SIGTERM is left alone where something
else handles it already (submitit's handlers under SLURM, which requeue the job).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupted(BaseException):  # a BaseException, as KeyboardInterrupt: `except Exception` lets it through
    """The process was told to stop (SIGTERM, SIGINT); `signum` is the signal that told it."""

    def __init__(self, message: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = signal.Signals(signum)


_state = {"deferring": False, "requested": None}


def stop_requested() -> str | None:
    """The signal that asked to stop at the end of the current step (inside `checkpoint_at_step_end`), or None."""
    return _state["requested"]


def _handle(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if _state["deferring"] and _state["requested"] is None:
        _state["requested"] = name
        print(f"{name}: stopping after this step with a checkpoint ({name} again: stop now)", file=sys.stderr)
        return
    raise Interrupted(name, signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGUSR1 raise `Interrupted` while the block runs (main thread only; elsewhere, nothing
    changes; SIGTERM and SIGUSR1 only where nothing else handles them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    ours = [signal.SIGINT] + [s for s in (signal.SIGTERM, signal.SIGUSR1) if previous[s] == signal.SIG_DFL]
    for s in ours:
        signal.signal(s, _handle)
    try:
        yield
    finally:
        for s in ours:
            signal.signal(s, previous[s])
        _state["requested"] = None


@contextmanager
def checkpoint_at_step_end() -> Iterator[None]:
    """While the block runs, a first stop signal waits for the step's end (see the module's docstring)."""
    _state["deferring"], _state["requested"] = True, None
    try:
        yield
    finally:
        _state["deferring"] = False
