"""The replication service of one saver: :class:`Replication` (the call order is in the package docstring).

It turns replication on with a rank's hello settings (store, secret, listener, peer record), picks
the copy policy (:func:`copy_policy`, the one place that reads ``$FLASHCKPT_REPLICA_ROUNDS``),
serves the ranks' ``replica_*`` operations and shuts it all down. The copies themselves are
:mod:`.transfer`'s, what the peers ask is :class:`~.server.PeerServer`'s, and when to copy is the
policy's. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ... import knobs
from ..protocol import TrainerOp
from ..storage import Storage
from . import peers
from .eager import Eager
from .peers import PeerDialer, PeerRecord
from .policy import CopyPolicy, PolicyContext, ReplicaSettings
from .rounds import Rounds
from .server import PeerServer
from .status import StatusFile
from .store import ReplicaStore
from .transfer import fetch_replica, survey

logger = logging.getLogger(__name__)

SURVEY_CACHE_S = 2.0
"""How long one survey of the job's savers answers the ranks' ``replica_inventory`` (they ask together)."""


def copy_policy(context: PolicyContext, settings: ReplicaSettings) -> CopyPolicy:
    """The copy policy of this saver: job-wide rounds (:class:`~.rounds.Rounds`), unless
    ``$FLASHCKPT_REPLICA_ROUNDS=0`` asks for per-snapshot pushes (:class:`~.eager.Eager`)."""
    if knobs.get(knobs.REPLICA_ROUNDS, "1") == "0":
        return Eager(context, settings)
    return Rounds(context, settings)


class Replication:
    """The replication service of one saver (see the package docstring)."""

    def __init__(self, run_dir: str, open_storage: Callable[[dict[str, Any]], Storage]) -> None:
        self.run_dir = run_dir
        self._open_storage = open_storage
        self.settings: ReplicaSettings | None = None
        self.store: ReplicaStore | None = None
        self.error: str | None = None
        self.status = StatusFile(run_dir)
        self._dialer: PeerDialer | None = None
        self._record: PeerRecord | None = None
        self._server: PeerServer | None = None
        self._policy: CopyPolicy | None = None
        self._lock = threading.Lock()
        self._ops = ThreadPoolExecutor(4, thread_name_prefix="replica-op")
        self._survey: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self._survey_lock = threading.Lock()
        self._closed = False

    @property
    def enabled(self) -> bool:
        """Whether replication runs on this node: a rank's hello turned it on, and it started."""
        return self._policy is not None

    def storage(self) -> Storage:
        return self._open_storage(self.settings.target)

    # --- set-up and shut-down --------------------------------------------------------------

    def configure(self, data: dict[str, Any]) -> None:
        """Turn replication on with a rank's hello settings, or follow a change of node or replica count."""
        try:
            settings = ReplicaSettings.from_dict(data)
        except (KeyError, ValueError, TypeError) as exc:
            logger.error("ignoring unusable replication settings %s: %s", data, exc)
            return
        with self._lock:
            if self._closed:
                return
            if self.settings is None:
                self._start(settings)
            elif (settings.nnodes, settings.replicas) != (self.settings.nnodes, self.settings.replicas):
                logger.info("replication now follows %d nodes with %d replica(s)", settings.nnodes, settings.replicas)
                self.settings = replace(self.settings, nnodes=settings.nnodes, replicas=settings.replicas)
                if self.enabled:
                    self._policy.retarget(self.settings)

    def _start(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        listener: socket.socket | None = None
        try:
            storage = self.storage()
            self._dialer = PeerDialer(storage, settings.job, peers.job_secret(storage), settings.node_rank)
            self.store = ReplicaStore(settings.shm_dir, settings.job)
            listener = socket.create_server((settings.addr, 0), backlog=64)
            port = listener.getsockname()[1]
            self._record = PeerRecord(settings.node_rank, settings.addr, port, settings.job, os.getpid(),
                                      settings.node_id, time.time())
            peers.publish(storage, self._record)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("replication is off on this node: %s", self.error)
            if listener is not None:
                listener.close()
            return
        self._policy = copy_policy(PolicyContext(self.run_dir, self.store, self._dialer, self.status), settings)
        self._server = PeerServer(listener, secret=self._dialer.secret, job=settings.job, store=self.store,
                                  run_dir=self.run_dir, policy=self._policy)
        self._server.start()
        self._policy.start()
        targets = self.targets()
        logger.info("replication on: node %d of %d listens on %s; its ranks' snapshots go to node(s) %s",
                    settings.node_rank, settings.nnodes, self._record.address, targets or "none")
        if not targets:
            logger.warning("replication is on but the job has a single node: no peer holds this node's snapshots")
        self.status.update(listen=self._record.address, node_rank=settings.node_rank, nnodes=settings.nnodes,
                           replicas=settings.replicas, targets=targets)

    def targets(self) -> list[int]:
        """The nodes that hold the replicas of this node's ranks."""
        return self.settings.targets() if self.settings is not None else []

    def close(self, *, remove: bool) -> None:
        """Stop; with ``remove`` (the job ended cleanly) its replicas, peer record and status go too."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._policy is not None:
            self._policy.close()
        if self._server is not None:
            self._server.close()
        if self._record is not None:
            with contextlib.suppress(Exception):
                peers.unpublish(self.storage(), self._record)
        if self.store is not None:
            self.store.remove_all() if remove else self.store.close()
        if remove:
            self.status.remove()
        self._ops.shutdown(wait=False, cancel_futures=True)

    # --- the ranks' ops --------------------------------------------------------------------

    def handle(self, conn: Any, request: dict[str, Any]) -> None:
        """Serve one rank request (``conn.send`` answers it); never blocks the saver's loop."""
        op, rid = request.get("op"), request.get("id")
        if not self.enabled:
            why = self.error or "no rank of this node turned it on"
            conn.send({"id": rid, "ok": False, "error": f"replication is off on this node: {why}"})
        elif op == TrainerOp.REPLICA_PUSH:
            self.offer(request)
            conn.send({"id": rid, "ok": True})
        elif op in (TrainerOp.REPLICA_INVENTORY, TrainerOp.REPLICA_FETCH):
            work = self.inventory_for if op == TrainerOp.REPLICA_INVENTORY else self.fetch
            self._ops.submit(self._answer, conn, rid, work, request)
        else:
            conn.send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})

    @staticmethod
    def _answer(conn: Any, rid: Any, work: Callable[[dict[str, Any]], dict[str, Any]],
                request: dict[str, Any]) -> None:
        try:
            conn.send({"id": rid, "ok": True, **work(request)})
        except Exception as exc:
            logger.warning("%s for rank %s failed: %s", request.get("op"), request.get("rank"), exc)
            conn.send({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def wants_pushes(self) -> bool:
        """Whether the ranks should offer each sealed slot (``replica_push``): as the copy policy says."""
        return self.enabled and self._policy.wants_pushes

    def offer(self, note: dict[str, Any]) -> None:
        """Hand rank ``note["rank"]``'s sealed slot to the copy policy."""
        note = {k: note[k] for k in ("rank", "slot", "step", "seq")}
        with self._lock:
            if self._closed:
                return
        self._policy.offer(note)

    def inventory_for(self, request: dict[str, Any]) -> dict[str, Any]:
        """The complete replicas of rank ``request["rank"]`` that the job's savers hold."""
        rank = int(request["rank"])
        found = [{**entry, "holder": node["record"]} for node in self.survey() if node["record"]
                 for entry in node["replicas"] if entry["rank"] == rank]
        return {"replicas": found}

    def survey(self) -> list[dict[str, Any]]:
        """What every published saver of the job holds (cached briefly: a node's ranks ask together)."""
        with self._survey_lock:
            taken, nodes = self._survey
            if time.monotonic() - taken < SURVEY_CACHE_S:
                return nodes
            nodes = survey(self._dialer)
            self._survey = (time.monotonic(), nodes)
            return nodes

    def fetch(self, request: dict[str, Any]) -> dict[str, Any]:
        """Copy the replica ``(rank, step, seq)`` from ``holder`` into the rank's slot ``slot``."""
        started = time.monotonic()
        holder = PeerRecord.from_dict(request["holder"])
        rank, step = int(request["rank"]), int(request["step"])
        nbytes = fetch_replica(self._dialer, holder, rank, step, int(request["seq"]), request["slot"])
        elapsed = time.monotonic() - started
        logger.info("rank %d fetched step %d from node %d's replica: %.1f MiB in %.2fs", rank, step,
                    holder.node_rank, nbytes / 2**20, elapsed)
        return {"bytes": nbytes, "seconds": elapsed, "from_node": holder.node_rank}
