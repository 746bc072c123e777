"""The CPU cores this process may run on: the default of every count of threads and processes.

Training threads and loader workers (:mod:`pipeline.train.runtime`), the build's encoding
processes (:mod:`pipeline.data.encode_pool`) and the index's shard readers follow it. This
module imports only the standard library (the build imports no torch).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor


def usable_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def resolve_workers(value: int | str) -> int:
    """A count of processes from a param: ``auto`` = :func:`usable_cores`, else the count.

    Args:
        value: ``auto`` or an int >= 1 (``data.build_workers``, validated by the params).
    """
    return usable_cores() if value == "auto" else int(value)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` processes started with ``spawn``, for the build's and the index's work.

    ``spawn``, not ``fork``: the stages may run threads (tqdm's monitor, MLflow's) whose locks a
    forked child would inherit held. A script that calls the build must then guard its entry
    point with ``if __name__ == "__main__"`` (the stages do).

    Args:
        workers: processes (>= 1; :func:`resolve_workers`).
    """
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
