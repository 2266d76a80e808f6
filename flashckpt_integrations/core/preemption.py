"""What a node's saver does when the job is being stopped: persist what only memory holds before
the grace period ends, under any launcher.

A preempted job gets SIGTERM (Kubernetes pod deletion, Slurm ``--signal``, a spot reclaim,
``kill`` on every process of the job), then SIGKILL once the grace period is over. Its ranks
die at once, but every snapshot they took is still in shared memory: the saver turns the
newest one into a commit while the grace lasts.

Call order, in the saver process:

1. :func:`install` (at start, main thread): SIGTERM and SIGINT set the saver's stop deadline
   (now + ``FLASHCKPT_GRACE_S``, default 30 s, the Kubernetes default grace) instead of killing it.
   A rank's ``stopping`` notice (its SIGTERM, see :mod:`.stop_notice`) sets it too, through
   :class:`StopRequests` on the serve loop: ``ask`` when it arrives, ``settle`` on every turn of
   the loop (a notice that follows a rank's failure is answered at once, nothing drained: the
   launcher is stopping the other ranks), ``answer`` once the drain is done.
2. The serve loop sees the deadline and goes on serving while ranks are still connected, until
   :func:`serve_until`: ranks killed by the same signal drop at once (the saver sums and takes up
   what each left behind); a rank that takes a last save on SIGTERM (``enable_jit_checkpoint``
   under ``FlashCkptTrainer``, :class:`flashckpt_integrations.StopSignal` in a loop of one's
   own) has its persist served as any other, as long as enough of the grace is left for
   the drain. Then it calls :func:`drain`: let the persists in flight finish, then persist the
   newest step every local rank holds in memory that is newer than the newest commit
   (:func:`.rescue.persist_newest`; the saver of global rank 0 commits it, waiting for the other
   nodes' savers, which do the same, until the deadline). What could not be finished is logged,
   never half-committed: a commit is one record written last.
3. The saver exits (its threads are not joined: a commit that waits for a lost node's ranks must
   not outlive the grace).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Protocol

from .. import knobs
from . import rescue

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
SETTLE_S = 2.0
"""How long a stopped saver still serves connected ranks (they are being killed too)."""
MARGIN_S = 1.0
"""Left of the grace at the end: the saver is done (logged, exited) before SIGKILL."""


class Drainable(Protocol):
    run_dir: str
    stop_deadline: float | None
    longest_persist_s: float
    """The longest persist this saver has done (0 when none): what the drain may need again."""

    def persists_in_flight(self) -> int: ...


def grace_s() -> float:
    """The grace period a stopped job has before SIGKILL (``FLASHCKPT_GRACE_S``)."""
    raw = knobs.get(knobs.GRACE_S)
    try:
        value = float(raw) if raw is not None else DEFAULT_GRACE_S
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %.0fs", knobs.GRACE_S, raw, DEFAULT_GRACE_S)
        return DEFAULT_GRACE_S
    return value if value > 0 else DEFAULT_GRACE_S


def install(saver: Drainable) -> None:
    """Make SIGTERM and SIGINT start the saver's drain instead of ending it."""

    def stop(signum: int, _frame: Any) -> None:
        begin(saver, signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def begin(saver: Drainable, why: str) -> None:
    """Start the saver's stop: its deadline is now + the grace."""
    if saver.stop_deadline is None:
        saver.stop_deadline = time.monotonic() + grace_s()
        logger.warning("%s: the job is being stopped; persisting what only memory holds within %.0fs", why, grace_s())


DECIDE_AFTER_S = 0.3
"""How long a rank's ``stopping`` notice waits before the saver decides on it: the disconnection
of a rank that failed (and made the launcher stop the others) may still be on its way."""
ALL_RANKS_WITHIN_S = 1.5
"""Where a notice says how many ranks the node runs (``local_world_size``, from the launcher), a
stop is a preemption only once that many ranks have sent one within this time: the launcher (or
the scheduler) signals every rank at once, and a rank that sends none is not being stopped but
is gone, its failure being why the launcher stops the others (a rank killed before it ever
connected to the saver leaves no disconnection behind to tell by)."""
FAILURE_WINDOW_S = 10.0
"""A notice this soon after a rank of the node disconnected without closing follows a failure."""


class Connection(Protocol):
    def send(self, message: dict[str, Any]) -> None: ...


class StopRequests:
    """The ranks' ``stopping`` notices on one saver (see the module docstring); serve-loop thread only."""

    def __init__(self) -> None:
        self._asked: list[tuple[Connection, Any, int, float]] = []
        self._waiting: list[tuple[Connection, Any]] = []
        self._failed_at: float | None = None
        self._notices: dict[int, float] = {}  # rank -> when its notice came
        self._local_ranks: int | None = None
        self.stopping: set[int] = set()
        """Ranks that asked and wait for the drain: they take no more saves."""

    @property
    def pending(self) -> bool:
        """Notices not decided on yet."""
        return bool(self._asked)

    def ask(self, conn: Connection, request: dict[str, Any]) -> None:
        now, rank = time.monotonic(), int(request["rank"])
        self._asked.append((conn, request.get("id"), rank, now))
        self._notices[rank] = now
        local = request.get("local_world_size")
        if isinstance(local, int) and local > 0:
            self._local_ranks = local

    def _missing_ranks(self, at: float) -> int | None:
        """How many of the node's ranks sent no notice near ``at``; None where that is unknown."""
        if self._local_ranks is None:
            return None
        near = sum(1 for t in self._notices.values() if abs(t - at) <= ALL_RANKS_WITHIN_S)
        return max(0, self._local_ranks - near)

    def rank_failed(self) -> None:
        """A rank disconnected without closing."""
        self._failed_at = time.monotonic()

    def settle(self, saver: Drainable) -> None:
        """Decide on the notices that waited :data:`DECIDE_AFTER_S` (all of them once stopping)."""
        now = time.monotonic()
        for item in list(self._asked):
            conn, rid, rank, at = item
            missing = self._missing_ranks(at)
            if saver.stop_deadline is None and (now - at < DECIDE_AFTER_S
                                                or (missing and now - at < ALL_RANKS_WITHIN_S)):
                continue
            self._asked.remove(item)
            failed = self._failed_at is not None and self._failed_at > at - FAILURE_WINDOW_S
            if saver.stop_deadline is None and (failed or missing):
                why = ("a rank of this node failed just before" if failed else
                       f"{missing} rank(s) of this node sent no notice with it (gone: a failure)")
                logger.info("rank %d got SIGTERM and %s: the launcher is stopping the others; nothing is drained",
                            rank, why)
                conn.send({"id": rid, "ok": True, "drained": False, "reason": f"{why}; nothing drained"})
                continue
            begin(saver, f"rank {rank} got SIGTERM")
            self.stopping.add(rank)
            self._waiting.append((conn, rid))

    def answer(self, result: rescue.RescueResult | None) -> None:
        """Tell the ranks waiting for the drain how it went (they then die of their SIGTERM)."""
        drained = result is not None and result.status in (rescue.RescueStatus.COMMITTED,
                                                            rescue.RescueStatus.PERSISTED)
        reason = result.reason if result is not None else "nothing was persisted"
        for conn, rid in self._waiting:
            conn.send({"id": rid, "ok": True, "drained": drained, "reason": reason})
        self._waiting = []


def serve_until(saver: Drainable) -> float:
    """Until when a stopped saver serves the ranks still connected (a monotonic time).

    Ranks still connected after :data:`SETTLE_S` are taking a last save: they are served while the
    grace leaves room for the drain to persist the newest snapshot afterwards (twice the longest
    persist seen, or half the grace when there was none).
    """
    deadline = saver.stop_deadline if saver.stop_deadline is not None else time.monotonic()
    seen = saver.longest_persist_s
    reserve = max(2 * seen, SETTLE_S) if seen > 0 else grace_s() / 2
    return deadline - MARGIN_S - reserve


def drain(saver: Drainable) -> rescue.RescueResult | None:
    """Finish the persists in flight, then persist (and commit, on rank 0's node) the newest
    step in memory newer than the newest commit, all before ``saver.stop_deadline``."""
    deadline = saver.stop_deadline if saver.stop_deadline is not None else time.monotonic() + grace_s()
    while saver.persists_in_flight() and time.monotonic() < deadline - MARGIN_S:
        time.sleep(0.02)
    if saver.persists_in_flight():
        logger.error("the grace period ended with %d persist(s) unfinished; their steps are not committed",
                     saver.persists_in_flight())
        return None
    slots = rescue.run_dir_slots(saver.run_dir)
    if not slots:
        return None
    left = deadline - MARGIN_S - time.monotonic()
    if left <= 0:
        logger.error("no time left of the grace period to persist the newest snapshot")
        return None
    started = time.monotonic()
    try:
        result = rescue.persist_newest(slots, commit_timeout=left)
    except Exception as exc:  # logged; the saver still exits before SIGKILL
        logger.error("could not persist the newest snapshot before the grace period ended: %s", exc)
        return None
    log = logger.error if result.status is rescue.RescueStatus.FAILED else logger.warning
    log("stopping: %s (%.1fs, %.1f MiB written)", result.reason, time.monotonic() - started,
        result.bytes_written / 2**20)
    return result
