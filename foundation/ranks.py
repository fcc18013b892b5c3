"""Which process of a data-parallel run this is. A run of N processes is started by `jobs/ranks.py` with
torchrun; each process reads its rank from torchrun's environment. A single process is rank 0 of 1."""

from __future__ import annotations

import os
import signal

RANK_OF = "ARL_RANK_OF"  # set in every process the launcher starts: the run directory they share
# A rank writes every thread's Python stack to its stderr on this signal (faulthandler, even inside a C call such as a
# collective): the launcher sends it to ranks that outlive a stop's grace period; `kill -QUIT <pid>` asks any time
STACKS_SIGNAL = signal.SIGQUIT


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """The process that writes the run directory (metrics, samples, results)."""
    return rank() == 0


def started_by_launcher() -> bool:
    """True in a process that `jobs/ranks.py` started (one of several ranks of one run)."""
    return RANK_OF in os.environ
