"""How many CPUs this process may run on, and how much of them nothing uses.

Call order: :func:`affinity_cpus` any time; :class:`IdleMeter` once, then :meth:`IdleMeter.rate`
at each decision that spends CPU in the background (the rate since the previous call).
"""

from __future__ import annotations

import os
import time


def affinity_cpus() -> int:
    """The CPUs in this process's affinity mask (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


CGROUP = "/sys/fs/cgroup"
"""Where a cgroup v2 container sees its own ``cpu.max`` and ``cpu.stat``."""


class IdleMeter:
    """Idle CPU seconds per second of this process's CPUs since the previous reading.

    Idle is the ``idle`` and ``iowait`` time of the CPUs in the affinity mask (``/proc/stat``);
    under a cgroup v2 CPU quota (a container's ``cpu.max``) it is at most the quota the cgroup
    left unused. A GPU node's CPUs mostly wait for the GPU, a CPU-bound node's hardly ever do.
    """

    def __init__(self, cgroup: str = CGROUP) -> None:
        self._cgroup = cgroup
        self._last = self._sample()

    def rate(self) -> float | None:
        """Idle CPUs (CPU seconds per second) since the previous call; None where unknown."""
        now = self._sample()
        last, self._last = self._last, now
        elapsed = now[0] - last[0]
        if elapsed <= 0 or now[1] is None or last[1] is None:
            return None
        idle = (now[1] - last[1]) / elapsed
        if now[2] is not None and last[2] is not None:
            quota, used = now[2][0], (now[2][1] - last[2][1]) / elapsed
            idle = min(idle, max(0.0, quota - used))
        return max(0.0, idle)

    def _sample(self) -> tuple[float, float | None, tuple[float, float] | None]:
        return time.monotonic(), _idle_seconds(), _cgroup_usage(self._cgroup)


def _idle_seconds() -> float | None:
    """The idle and iowait seconds of the CPUs this process may run on, since boot."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = None
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        if cpus is not None and int(fields[0][3:]) not in cpus:
            continue
        ticks += int(fields[4]) + (int(fields[5]) if len(fields) > 5 else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def _cgroup_usage(root: str) -> tuple[float, float] | None:
    """(the quota in CPUs, the CPU seconds used since the cgroup began) under a cgroup v2 CPU
    quota; None without one."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        with open(os.path.join(root, "cpu.stat")) as f:
            usage = next(int(line.split()[1]) for line in f if line.startswith("usage_usec"))
        return int(quota) / int(period), usage / 1e6
    except (OSError, ValueError, StopIteration, IndexError):
        return None
