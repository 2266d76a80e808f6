"""How much of a node replication may take: the pacing knobs that both copy policies read.

:func:`copy_duty` bounds the share of the time copies take (after a copy of ``d`` seconds the next
starts ``d * (1 / duty - 1)`` later: :mod:`.eager` per peer, :mod:`.rounds` per kept round);
:func:`cpu_share` and :func:`idle_share` bound the CPU time a round costs its busiest node
(:mod:`.rounds`, through :func:`cpu_allowance`). No torch here.
"""

from __future__ import annotations

import logging

from ... import knobs

logger = logging.getLogger(__name__)


def copy_duty() -> float:
    """The share of the time a saver's copies to one peer may take (``$FLASHCKPT_REPLICA_DUTY``,
    default 0.1; 1 copies back to back)."""
    return _share(knobs.REPLICA_DUTY, 0.1)


def cpu_share() -> float:
    """The share of a node's CPU time its saver's replication rounds may take (``$FLASHCKPT_REPLICA_CPU``,
    default 0.01): on a node whose CPUs all train, what replication costs the training steps."""
    return _share(knobs.REPLICA_CPU, 0.01)


def idle_share() -> float:
    """The share of a node's idle CPU time replication rounds may take beyond :func:`cpu_share`
    (``$FLASHCKPT_REPLICA_IDLE``, default 0.5)."""
    return _share(knobs.REPLICA_IDLE, 0.5)


def cpu_allowance(cpus: int, idle: float | None) -> float:
    """The CPU seconds per second a node's rounds may take: ``cpu_share`` of its ``cpus``, or
    ``idle_share`` of the ``idle`` CPUs it had since its previous round (None: unknown), whichever
    is more. A node whose CPUs train takes the first; one whose CPUs wait for GPUs, the second."""
    return max(cpu_share() * cpus, idle_share() * (idle or 0.0))


def _share(knob: str, default: float) -> float:
    """The share in (0, 1] that ``knob`` sets; ``default`` when unset, or (logged) when unusable."""
    value = knobs.get(knob)
    if value is None:
        return default
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        logger.error("%s=%r must be a number in (0, 1]; using %s", knob, value, default)
        return default
    return share
