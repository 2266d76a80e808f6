"""Per-snapshot pushes: each rank's newest sealed snapshot goes to every placement target on its own.

The copy policy when ``$FLASHCKPT_REPLICA_ROUNDS=0`` (:class:`Eager`, a :class:`~.policy.CopyPolicy`):
the ranks offer each sealed slot to their saver (``replica_push``), which queues it for one
:class:`_Sender` thread per target node; a newer snapshot of a rank replaces one not yet sent.
No step is kept in common across the job (see :mod:`.rounds` for why that matters after a node
is lost), and nothing overwrites a replica's previous copy until the new one is whole.

Call order: :meth:`Eager.offer` for each offered snapshot -> the node's :class:`_Sender` ->
:func:`.transfer.push_copy` on its channel; :meth:`Eager.retarget` stops the senders of nodes no
longer targeted; :meth:`Eager.close` stops them all. No torch here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..shm_buffer import Slot
from .pacing import copy_duty
from .peers import Channel
from .policy import PolicyContext, ReplicaSettings
from .transfer import SEND_TIMEOUT_S, push_copy

logger = logging.getLogger(__name__)


class Eager:
    """Per-snapshot pushes from one saver (see the module docstring)."""

    wants_pushes = True
    """The ranks offer each sealed snapshot (``replica_push``)."""

    def __init__(self, context: PolicyContext, settings: ReplicaSettings) -> None:
        self.context = context
        self.settings = settings
        self._senders: dict[int, _Sender] = {}
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Nothing: a node's sender starts with the first snapshot offered for it."""

    def retarget(self, settings: ReplicaSettings) -> None:
        """Follow a new node or replica count: the senders of nodes no longer targeted stop."""
        with self._lock:
            self.settings = settings
            for node in set(self._senders) - set(settings.targets()):
                self._senders.pop(node).stop()

    def offer(self, note: dict[str, Any]) -> None:
        """Queue rank ``note["rank"]``'s sealed slot for every target (a newer one replaces it)."""
        with self._lock:
            if self._closed:
                return
            for node in self.settings.targets():
                sender = self._senders.get(node)
                if sender is None:
                    sender = self._senders[node] = _Sender(self.context, node)
                sender.offer(note)

    def handles(self, op: str) -> bool:
        """None: every peer operation these copies need is served by :mod:`.transfer`."""
        return False

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"ok": False, "error": f"unknown op {message.get('op')!r}"}

    def kept(self) -> int | None:
        """None: any replica may be overwritten by a newer copy."""
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.stop()


class _Sender:
    """Streams the newest sealed snapshot of each rank to one peer node, on its own thread.

    Only the newest snapshot per rank waits: a newer one replaces one not yet sent. A failed copy
    (peer unreachable, refused, gone mid-copy) is retried with backoff, with the newest snapshot.
    Copies take at most ``duty`` of the time (:func:`.pacing.copy_duty`): after one that took ``d``
    seconds the next starts ``d * (1 / duty - 1)`` later, so that snapshots taken every step cost
    training a bounded share of the host, at the price of a replica that lags the newest snapshot.
    """

    def __init__(self, context: PolicyContext, node: int) -> None:
        self.context = context
        self.node = node
        self._duty = copy_duty()
        self._next_at = 0.0
        self._pending: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._retry_at = 0.0
        self._channel: Channel | None = None
        self._sources: dict[str, Slot] = {}
        self._failing: type | None = None
        """The kind of the failures since the last copy that worked (None: it worked)."""
        self._succeeded = False
        threading.Thread(target=self._run, name=f"replica-to-node{node}", daemon=True).start()

    def offer(self, note: dict[str, Any]) -> None:
        with self._cond:
            self._pending.pop(note["rank"], None)
            self._pending[note["rank"]] = note
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        channel = self._channel
        if channel is not None:
            channel.close()

    def _next(self) -> dict[str, Any] | None:
        with self._cond:
            while not self._stopped:
                wait = max(self._retry_at, self._next_at) - time.monotonic()
                if self._pending and wait <= 0:
                    return self._pending.pop(next(iter(self._pending)))
                self._cond.wait(wait if self._pending else None)
            return None

    def _run(self) -> None:
        backoff = 0.5
        while (note := self._next()) is not None:
            try:
                started = time.monotonic()
                self._push(note)
                self._next_at = time.monotonic() + (time.monotonic() - started) * (1 / self._duty - 1)
                backoff = 0.5
            except Exception as exc:  # unreachable, refused, gone mid-copy: retried, newest first
                self._drop_channel()
                if self._stopped:
                    break
                reason = f"{type(exc).__name__}: {exc}"
                self.context.status.report(self.node, note, ok=False, reason=reason)
                said = self._failing is type(exc)  # a new kind of failure (a refusal above all) is always told
                (logger.debug if said else logger.warning)(
                    "could not copy rank %s step %s to node %d (retrying in %.1fs): %s", note["rank"], note["step"],
                    self.node, backoff, reason)
                self._failing = type(exc)
                with self._cond:
                    self._pending.setdefault(note["rank"], note)
                    self._retry_at = time.monotonic() + backoff
                backoff = min(backoff * 2, 10.0)
        self._drop_channel()
        for slot in self._sources.values():
            slot.close()

    def _source(self, path: str) -> Slot | None:
        slot = self._sources.get(path)
        if slot is not None and (slot.replaced() or slot.file_size() != slot.size):
            slot.close()
            slot = None
        if slot is None:
            slot = Slot.attach(path)
            if slot is None:
                self._sources.pop(path, None)
                return None
            self._sources[path] = slot
        return slot

    def _connect(self) -> Channel:
        if self._channel is None:
            self._channel = self.context.dialer.connect_node(self.node, timeout=SEND_TIMEOUT_S)
        return self._channel

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _push(self, note: dict[str, Any]) -> None:
        slot = self._source(note["slot"])
        if slot is None or push_copy(self.context.status, self.node, self._connect, slot, note) != "ok":
            return
        (logger.info if self._failing is not None or not self._succeeded else logger.debug)(
            "rank %s step %s is replicated on node %d", note["rank"], note["step"], self.node)
        self._failing, self._succeeded = None, True
