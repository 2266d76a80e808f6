"""Fault points: SIGKILL this process at a named point of the save path (tests and debugging).

``FLASHCKPT_FAULT="point[@n][,point[@n]...]"`` kills the process the ``n``-th time (default:
the first) it reaches ``point``. The knob is read once, when this module is imported; when it
is unset every point is a call that returns at once. Points:

``trainer.copy``     the trainer, during the memory copy, after each region is in place
``trainer.sealed``   the trainer, between sealing a slot and asking the saver to persist it
``saver.write``      the saver, in the middle of writing a file (before each tensor's bytes)
``saver.commit``     the committer, once every rank's done marker exists, before the commit
``saver.supersede``  the committer, after the commit record switched to a save that replaces a
                     committed one, before its files are moved into the step's directory
``retention.delete`` the committer's retention, after a step lost its commit record and
                     before its files are deleted
``replica.receive``  a saver receiving a peer's snapshot (a replica, or a restore's fetch), once
                     per copy, after its first chunk is in place

A process started by one that has the knob inherits it (the saver inherits its starter's).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from .. import knobs

logger = logging.getLogger(__name__)

POINTS = ("trainer.copy", "trainer.sealed", "saver.write", "saver.commit", "saver.supersede", "retention.delete",
          "replica.receive")


def parse(spec: str | None) -> dict[str, int]:
    """``"a@3,b"`` -> ``{"a": 3, "b": 1}``; raises ``ValueError`` on a malformed spec."""
    plan: dict[str, int] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        point, _, count = item.partition("@")
        if point not in POINTS or (count and (not count.isdigit() or int(count) < 1)):
            raise ValueError(
                f"{knobs.FAULT}={spec!r}: {item!r} is not 'point[@n]' with n >= 1 and point one of "
                f"{', '.join(POINTS)}; fix or unset it"
            )
        plan[point] = int(count or 1)
    return plan


_PLAN = parse(knobs.get(knobs.FAULT))
_hits: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(point: str) -> None:
    """Kill this process here if the fault knob names ``point`` and this is its n-th visit."""
    if not _PLAN or point not in _PLAN:
        return
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        fire = _hits[point] == _PLAN[point]
    if fire:
        logger.warning("fault injection: SIGKILL at %s (visit %d) in pid %d", point, _PLAN[point], os.getpid())
        for handler in logging.getLogger().handlers:  # the saver logs to a file: keep the last words
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def after_region(on_copied: Callable[[int], Any] | None) -> Callable[[int], Any] | None:
    """Wrap a copy's per-region callback with the ``trainer.copy`` point (unchanged when disarmed)."""
    if "trainer.copy" not in _PLAN:
        return on_copied

    def hook(regions: int) -> None:
        if on_copied is not None:
            on_copied(regions)
        fault_point("trainer.copy")

    return hook
