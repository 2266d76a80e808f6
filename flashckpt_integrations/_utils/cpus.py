"""How many CPUs this process may run on."""

from __future__ import annotations

import os


def affinity_cpus() -> int:
    """The CPUs in this process's affinity mask (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
