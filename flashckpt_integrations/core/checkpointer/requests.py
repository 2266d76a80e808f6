"""A rank's persist requests to its node's saver, and what it learns of their commits.

Call order: ``PersistRequests(...)`` -> ``connect_quietly()`` (queued at once: the saver starts
off the training path) -> per persisting save: ``describe(...)`` (the request, also kept in the
slot's metadata) -> ``submit(slot, ...)`` once the slot is sealed (sent from the request thread,
in save order, one at a time, each answered when the rank's files are durable; rank 0's when the
step is committed) -> ``track(result)`` -> ``wait(timeout)`` where the caller needs durability ->
``leave()`` on an unclean end (unanswered requests are left to the saver) -> ``close()``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...config import CheckpointerConfig
from ...errors import FlashCkptError, SaverProcessError
from .. import commit as commit_protocol
from .. import lineage
from ..client import SaverClient
from ..layout import Layout, read_json
from ..protocol import TrainerOp
from ..results import PersistResult, SaveResult
from ..shm_buffer import Slot
from ..storage import Storage

logger = logging.getLogger(__name__)

ERROR_EXIT_WAIT_S = 5.0
"""How long a process that exits on an error (a peer lost mid-collective, say) waits for its
in-flight persists: the node's saver finishes them without it, and a commit that needs a lost
node's ranks may never come, so an unbounded wait would keep the launcher from relaunching."""
MAPPED_WAIT_S = 10.0
"""How long ``prepare()`` waits for the saver to map the slots it made (it may be persisting)."""
EXITING = threading.Event()
"""Set when the interpreter starts to exit: before it joins the request thread, so before any
atexit hook (``threading._register_atexit``, the hook ``concurrent.futures`` uses itself)."""
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(EXITING.set)


class PersistRequests:
    """The persist requests of one rank (see the module docstring)."""

    def __init__(self, client: SaverClient, config: CheckpointerConfig, *, rank: int, world_size: int, url: str,
                 storage: Storage, layout: Layout, writer: dict[str, Any], held_path: str,
                 committed_steps: Callable[[], list[int]]) -> None:
        self.client, self.config = client, config
        self.rank, self.world_size, self.url = rank, world_size, url
        self.storage, self.layout, self.writer, self.held_path = storage, layout, writer, held_path
        self._committed_steps = committed_steps
        self._requester = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-request")
        self._pending: list[SaveResult] = []
        self._newest: SaveResult | None = None
        self._saves_of: dict[int, int] = {}
        self.leaving = False
        """Set by an unclean end: requests still unanswered are left to the saver."""

    def queue(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn`` on the request thread, after the requests queued before it."""
        return self._requester.submit(fn, *args)

    def connect_quietly(self) -> None:
        """Start or find the saver from the request thread; a failure is retried at persist time."""
        self._requester.submit(self._connect_quietly)

    def _connect_quietly(self) -> None:
        try:
            self.client.connect()
        except SaverProcessError as exc:
            logger.warning("[RANK %d] saver not reachable yet: %s", self.rank, exc)

    def announce(self, path: str) -> None:
        """Let the saver map a new or grown slot before its first persist (best effort, queued)."""
        self._requester.submit(self._announce, path)

    def _announce(self, path: str) -> None:
        try:
            self.client.connect()
            self.client.request({"op": TrainerOp.ATTACH, "rank": self.rank, "slot": path})
        except SaverProcessError as exc:
            logger.debug("[RANK %d] could not announce slot %s: %s", self.rank, path, exc)

    def wait_mapped(self, paths: list[str], timeout: float = MAPPED_WAIT_S) -> None:
        """Have a running saver map ``paths`` now and wait until it has (``prepare()``: neither the
        first save nor the first persist then shares the CPU with it). A saver not up is not waited for."""
        if not self.client.connected:
            return
        answers = [self.client.request({"op": TrainerOp.ATTACH, "rank": self.rank, "slot": path, "answer": "mapped"})
                   for path in paths]
        deadline = time.monotonic() + timeout
        for answer in answers:
            try:
                answer.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # its first persist maps it instead
                logger.debug("[RANK %d] the saver did not map the slots ahead: %s", self.rank, exc)
                return

    # --- a request --------------------------------------------------------------------------------

    def target(self, layout: Layout | None = None) -> dict[str, Any]:
        """Where and how this rank's snapshots are persisted (``layout``: a save's own, with its
        folder); every slot's metadata carries it."""
        return {
            "root": self.url, "storage_options": self.config.storage_options,
            "storage_factory": self.config.storage_factory, "layout": (layout or self.layout).to_dict(),
            "retention": self.config.retention.to_dict(), "commit_timeout": self.config.commit_timeout_s,
        }

    def save_id(self, step: int, view: lineage.View) -> str:
        """The id of this attempt's next persisted save of ``step``: the same on every rank."""
        count = self._saves_of.get(step, 0)
        self._saves_of[step] = count + 1
        return f"a{view.lineage}" + (f"g{count}" if count else "")

    def describe(self, step: int, seq: int, slot_path: str, sid: str, tag: dict[str, Any],
                 layout: Layout | None = None) -> dict[str, Any]:
        """What the saver needs to persist one snapshot (sent to it, and kept in the slot)."""
        request = {"rank": self.rank, "world_size": self.world_size, "step": step, "seq": seq, "slot": slot_path,
                   "sid": sid, "tag": tag, "pid": os.getpid(), "writer": self.writer, **self.target(layout)}
        if slot_path == self.held_path:
            request["held"] = True  # the saver unmaps it afterwards: its memory goes once it is released
        return request

    def submit(self, slot: Slot, request: dict[str, Any], durable: Future) -> None:
        """Queue ``request`` (:meth:`describe`) for a sealed (or, streamed, a sealing) slot;
        ``durable`` gets the answer."""
        try:
            self._requester.submit(self._request, slot, request, durable)
        except RuntimeError:  # the interpreter is exiting (a helper thread sealed it): executors
            self._requester.shutdown(wait=True)  # take no new work; the requests before this go
            self._request(slot, request, durable)  # first, then this one, here

    def _request(self, slot: Slot, described: dict[str, Any], durable: Future) -> None:
        """Hand a slot to the saver and wait until the rank's files are durable.

        Runs on the request thread, in save order. A saver that dies is restarted and asked
        again once: the slot still holds the snapshot, and rewriting files is idempotent.
        """
        request = {"op": TrainerOp.PERSIST, **described}
        step, seq = described["step"], described["seq"]
        answer: dict[str, Any] | None = {}
        left = {"ok": False, "error": f"the process left before step {step} was persisted; the node's saver "
                "persists it from the slot"}
        for attempt in range(2):
            if self.leaving:  # the request is in the slot: the saver takes it up when this process is gone
                durable.set_result(left)
                return
            try:
                self.client.connect()
                answer = self._await_answer(self.client.request(request))
                if answer is None:
                    durable.set_result(left)
                    return
                break
            except SaverProcessError as exc:
                answer = {"ok": False, "error": f"the saver is unavailable: {exc}"}
                if attempt == 0:
                    logger.warning("[RANK %d] %s; restarting it and retrying step %d", self.rank, exc, step)
                else:
                    slot.mark_persist_done(seq)  # given up and reported: no saver should pick it up later
        if not answer.get("ok"):
            error = f"rank {self.rank} could not persist step {step}; it stays in memory only: {answer.get('error')}"
            logger.error("[RANK %d] %s", self.rank, error)
            answer = {"ok": False, "error": error}
        durable.set_result(answer)

    def _await_answer(self, future: Future) -> dict[str, Any] | None:
        """The saver's answer to a request; None when this process is exiting on an error and
        ``ERROR_EXIT_WAIT_S`` have passed (the interpreter joins this thread before any atexit
        hook runs, and the answer may wait for a commit that a lost peer never completes)."""
        exiting_since = None
        while True:
            try:
                return future.result(timeout=0.25)
            except concurrent.futures.TimeoutError:
                if self.leaving:
                    return None
                if not EXITING.is_set() or getattr(sys, "last_value", None) is None:
                    continue  # training goes on, or a clean exit: a clean end waits until it is durable
                exiting_since = exiting_since or time.monotonic()
                if time.monotonic() - exiting_since > ERROR_EXIT_WAIT_S:
                    logger.warning("[RANK %d] exiting on an error with a persist unanswered; the node's saver "
                                   "finishes it (a step a lost peer cannot complete is not committed)", self.rank)
                    return None

    # --- outcomes ---------------------------------------------------------------------------------

    def track(self, result: SaveResult) -> None:
        """Remember a persisting save: ``wait()`` waits for it."""
        self._pending = [r for r in self._pending if not r.durable_done()] + [result]
        self._newest = result

    def wait(self, timeout: float | None = None) -> PersistResult | None:
        """Wait for every tracked save to be committed (or to fail); the newest one's outcome."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for result in list(self._pending):
            result.wait(left())
        self._pending = [r for r in self._pending if not r.durable_done()]
        newest = self._newest
        return None if newest is None else newest.wait(left())

    def commit_poller(self, sid: str) -> Callable[..., PersistResult]:
        """How a save's result watches for the commit of save ``sid``."""
        return lambda step, timeout=None: self.poll_commit(step, timeout, sid)

    def poll_commit(self, step: int, timeout: float | None = None, sid: str = "") -> PersistResult:
        """Watch storage until save ``sid`` of ``step`` is committed or failed (works on every node)."""
        limit = self.config.commit_timeout_s + 30
        deadline = time.monotonic() + (limit if timeout is None else min(timeout, limit))
        marker_dir = Layout.marker_dir(step)
        delay, cap = 0.005, (0.25 if "://" in self.url else 0.05)  # a local listing is cheap; an object store's is not
        while time.monotonic() < deadline:
            try:
                outcome = self._commit_outcome(step, sid, marker_dir)
                if outcome is not None:
                    return outcome
            except FlashCkptError as exc:
                logger.warning("[RANK %d] cannot read commit state of step %d: %s", self.rank, step, exc)
            time.sleep(delay)
            delay = min(delay * 2, cap)
        if timeout is not None and timeout < limit:
            raise TimeoutError(f"step {step} was not committed within {timeout}s; it may still be")
        return PersistResult(step, False, f"no commit of step {step} appeared within the commit timeout")

    def _commit_outcome(self, step: int, sid: str, marker_dir: str) -> PersistResult | None:
        names = set(self.storage.list(marker_dir))
        outcome, failure = commit_protocol.settled(self.storage, step, sid, names)
        if outcome == "committed":
            return PersistResult(step, True)
        if not names and any(s > step for s in self._committed_steps()):
            return PersistResult(step, True)  # this rank's marker was there: retention deleted the step
        if outcome == "failed":
            mine_path = self.layout.rank_marker(step, self.rank, sid=sid)
            mine = read_json(self.storage, mine_path) if self.storage.exists(mine_path) else {}
            if failure.get("time", 0) >= mine.get("time", 0):
                reason = failure.get("reason")
                logger.error("[RANK %d] step %d was not committed: %s", self.rank, step, reason)
                return PersistResult(step, False, reason)
        return None

    def leave(self) -> None:
        """An unclean end: answers still awaited (a commit a lost peer holds up) are not waited for."""
        self.leaving = True
        self.client.close(clean=False)

    def close(self) -> None:
        self._requester.shutdown(wait=True)
