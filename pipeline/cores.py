"""The CPU cores this process may run on: the default of every count of threads and processes.

Training threads and loader workers (:mod:`pipeline.train.runtime`), the build's encoding
processes (:mod:`pipeline.data.encode_pool`) and the index's shard readers follow it. This
module imports only the standard library (the build imports no torch).
"""

from __future__ import annotations

import os


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
