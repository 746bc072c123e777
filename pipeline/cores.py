"""The CPU cores this process may run on: the default of every count of threads and processes.

Training threads and loader workers (:mod:`pipeline.train.runtime`) and the build's encoding
processes (:mod:`pipeline.data.encode_pool`) follow it. This module imports only the standard
library (the build imports no torch).
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
