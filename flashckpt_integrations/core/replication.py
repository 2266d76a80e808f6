"""Peer replicas of memory snapshots, in the saver: the sender, the receiver and restore fetches.

A node's saver copies each newest sealed snapshot of its ranks to the savers of the next
``replicas`` nodes (:func:`.peers.placement`), which keep them in replica slots
(:mod:`.replica_slots`). A replacement node's ranks then restore from those copies instead of
storage (:mod:`.replica_restore`). Everything here is best effort and off the training path: a
save never waits for a copy, a persist never waits for a peer, a slow or dead peer only delays
or drops copies (logged, and shown by ``flashckpt ls``).

Call order (one :class:`Replication` per saver):

1. :meth:`Replication.configure` with a rank's hello settings (:class:`ReplicaSettings`). The
   first opens the store, reads the job secret, listens on TCP and publishes the saver's
   :class:`~.peers.PeerRecord`; later ones only follow a change of node or replica count.
2. :meth:`Replication.handle` serves the ranks' ops: ``replica_push`` (a sealed slot: queued for
   each peer, answered at once), ``replica_inventory`` (what the job's savers hold for a rank: the
   published peers are asked), ``replica_fetch`` (copy one replica from its holder into the
   rank's own slot).
3. :meth:`Replication.close` stops senders and listener; on a clean end of the job it removes
   the replica slots, the peer record and the status file.

Between savers, on the authenticated channel of :mod:`.peers`: ``push`` (a copy for the store:
announced, accepted or skipped with the reason, streamed (only the bytes the receiver's own
data-parallel ranks do not hold: :mod:`.replica_reuse`), then confirmed intact by the sender),
``inventory`` and ``fetch``. The source slot is read optimistically, never locked: its header is
read before and after the bytes, and a copy whose source changed meanwhile is discarded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from .. import knobs
from ..errors import CorruptCheckpointError
from . import peers, replica_reuse, replica_rounds
from .peers import Channel, PeerAuthError, PeerRecord
from .replica_slots import (
    ReplicaSkipped,
    ReplicaStore,
    check_head,
    head_of,
    read_record,
    recv_range,
    same_snapshot,
    seal_copy,
    send_range,
)
from .shm_buffer import HEADER_SIZE, Slot, SlotState
from .storage import Storage

logger = logging.getLogger(__name__)

STATUS_FILE = "replication.json"
"""In the saver's run directory: its listener, its peers and the outcome of its newest copies."""
SEND_TIMEOUT_S = 30.0
"""A peer that takes longer than this for one send or answer is given up (and retried later)."""
SURVEY_CACHE_S = 2.0
MAX_PEER_CONNECTIONS = 64


@dataclass(frozen=True)
class ReplicaSettings:
    """What a rank tells its saver about replication (in its hello)."""

    job: str
    node_rank: int
    nnodes: int
    replicas: int
    shm_dir: str
    addr: str
    node_id: str
    target: dict[str, Any]
    """``root``, ``storage_options``, ``storage_factory``: how to open the checkpoint storage."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaSettings:
        settings = cls(str(data["job"]), int(data["node_rank"]), int(data["nnodes"]), int(data["replicas"]),
                       str(data["shm_dir"]), str(data["addr"]), str(data.get("node_id", "")), dict(data["target"]))
        if settings.replicas not in (1, 2) or not 0 <= settings.node_rank < max(settings.nnodes, 1):
            raise ValueError(f"replicas={settings.replicas} (1 or 2), node rank {settings.node_rank} of "
                             f"{settings.nnodes} nodes")
        return settings


class Replication:
    """The replication service of one saver (see the module docstring)."""

    def __init__(self, run_dir: str, open_storage: Callable[[dict[str, Any]], Storage]) -> None:
        self.run_dir = run_dir
        self._open_storage = open_storage
        self.settings: ReplicaSettings | None = None
        self.store: ReplicaStore | None = None
        self.error: str | None = None
        self._secret = b""
        self._record: PeerRecord | None = None
        self._listener: socket.socket | None = None
        self._senders: dict[int, _Sender] = {}
        self._lock = threading.Lock()
        self._ops = ThreadPoolExecutor(4, thread_name_prefix="replica-op")
        self._connections = threading.BoundedSemaphore(MAX_PEER_CONNECTIONS)
        self._survey: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self._survey_lock = threading.Lock()
        self._status: dict[str, Any] = {"sent": {}}
        self._local_crcs = replica_reuse.LocalCrcs()
        self.rounds: replica_rounds.Rounds | None = None
        self._status_lock = threading.Lock()
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.settings is not None and self.error is None

    def storage(self) -> Storage:
        return self._open_storage(self.settings.target)

    # --- set-up and shut-down --------------------------------------------------------------

    def configure(self, data: dict[str, Any]) -> None:
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
                for node in set(self._senders) - set(self.targets()):
                    self._senders.pop(node).stop()

    def _start(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        try:
            storage = self.storage()
            self._secret = peers.job_secret(storage)
            self.store = ReplicaStore(settings.shm_dir, settings.job)
            self._listener = socket.create_server((settings.addr, 0), backlog=64)
            host, port = self._listener.getsockname()[:2]
            self._record = PeerRecord(settings.node_rank, settings.addr, port, settings.job, os.getpid(),
                                      settings.node_id, time.time())
            peers.publish(storage, self._record)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("replication is off on this node: %s", self.error)
            if self._listener is not None:
                self._listener.close()
            return
        threading.Thread(target=self._accept_loop, name="replica-listen", daemon=True).start()
        if replica_rounds.enabled():
            self.rounds = replica_rounds.Rounds(self)
            self.rounds.start()
        targets = self.targets()
        logger.info("replication on: node %d of %d listens on %s; its ranks' snapshots go to node(s) %s",
                    settings.node_rank, settings.nnodes, self._record.address, targets or "none")
        if not targets:
            logger.warning("replication is on but the job has a single node: no peer holds this node's snapshots")
        self._update_status(listen=self._record.address, node_rank=settings.node_rank, nnodes=settings.nnodes,
                            replicas=settings.replicas, targets=targets)

    def targets(self) -> list[int]:
        s = self.settings
        return peers.placement(s.node_rank, s.nnodes, s.replicas) if s is not None else []

    def close(self, *, remove: bool) -> None:
        """Stop; with ``remove`` (the job ended cleanly) its replicas, peer record and status go too."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.stop()
        if self.rounds is not None:
            self.rounds.close()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._record is not None:
            with contextlib.suppress(Exception):
                peers.unpublish(self.storage(), self._record)
        if self.store is not None:
            self.store.remove_all() if remove else self.store.close()
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, STATUS_FILE))
        self._ops.shutdown(wait=False, cancel_futures=True)

    # --- the ranks' ops --------------------------------------------------------------------

    def handle(self, conn: Any, request: dict[str, Any]) -> None:
        """Serve one rank request (``conn.send`` answers it); never blocks the saver's loop."""
        op, rid = request.get("op"), request.get("id")
        if not self.enabled:
            why = self.error or "no rank of this node turned it on"
            conn.send({"id": rid, "ok": False, "error": f"replication is off on this node: {why}"})
        elif op == "replica_push":
            self.offer(request)
            conn.send({"id": rid, "ok": True})
        elif op in ("replica_inventory", "replica_fetch"):
            work = self.inventory_for if op == "replica_inventory" else self.fetch
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
        """Whether the ranks should offer each sealed slot (``replica_push``): not with rounds,
        which copy the steps they keep themselves."""
        return self.enabled and self.rounds is None

    def offer(self, note: dict[str, Any]) -> None:
        """Queue rank ``note["rank"]``'s sealed slot for every peer (a newer one replaces it)."""
        note = {k: note[k] for k in ("rank", "slot", "step", "seq")}
        with self._lock:
            if self._closed or self.rounds is not None:  # rounds copy what they keep themselves
                return
            for node in self.targets():
                sender = self._senders.get(node)
                if sender is None:
                    sender = self._senders[node] = _Sender(self, node)
                sender.offer(note)

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
            nodes = survey(self.storage(), self.settings.job, self._secret, self.settings.node_rank)
            self._survey = (time.monotonic(), nodes)
            return nodes

    def fetch(self, request: dict[str, Any]) -> dict[str, Any]:
        """Copy the replica ``(rank, step, seq)`` from ``holder`` into the rank's slot ``slot``."""
        started = time.monotonic()
        holder = PeerRecord.from_dict(request["holder"])
        rank, step, seq = int(request["rank"]), int(request["step"]), int(request["seq"])
        channel = peers.connect(holder, self._secret, self.settings.job, self.settings.node_rank,
                                timeout=SEND_TIMEOUT_S)
        try:
            channel.send({"op": "fetch", "rank": rank, "step": step, "seq": seq})
            head = channel.recv()
            if not head.get("ok"):
                raise RuntimeError(f"node {holder.node_rank} has no such replica: {head.get('error')}")
            if check_head(head)[:2] != (step, seq):
                raise RuntimeError(f"node {holder.node_rank} answered with step {head['step']} seq {head['seq']}")
            nbytes = receive_copy(channel, request["slot"], rank, head, expected_crc=int(head["data_crc"]))
        finally:
            channel.close()
        elapsed = time.monotonic() - started
        logger.info("rank %d fetched step %d from node %d's replica: %.1f MiB in %.2fs", rank, step,
                    holder.node_rank, nbytes / 2**20, elapsed)
        return {"bytes": nbytes, "seconds": elapsed, "from_node": holder.node_rank}

    # --- the peers' side -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._closed:
            try:
                sock, address = listener.accept()
            except OSError:
                break
            where = f"{address[0]}:{address[1]}"
            if not self._connections.acquire(blocking=False):
                logger.warning("refused a replication connection from %s: %d are open", where, MAX_PEER_CONNECTIONS)
                sock.close()
                continue
            threading.Thread(target=self._serve_peer, args=(sock, where), name="replica-peer", daemon=True).start()

    def _serve_peer(self, sock: socket.socket, address: str) -> None:
        try:
            accepted = peers.accept(sock, address, self._secret, self.settings.job)
            if accepted is None:
                return
            channel, node = accepted
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a peer host that vanished is noticed
            with contextlib.closing(channel):
                while not self._closed:
                    sock.settimeout(None)  # a peer's connection may idle between copies
                    message = channel.recv()
                    sock.settimeout(SEND_TIMEOUT_S)  # a copy that stalls is given up: the previous one stays
                    op = message.get("op")
                    if op == "push":
                        self._receive(channel, message, node)
                    elif op == "inventory":
                        channel.send({"ok": True, "replicas": self.store.inventory(), "local": self.local_inventory()})
                    elif op == "fetch":
                        self._serve_fetch(channel, message)
                    elif op in replica_rounds.OPS and self.rounds is not None:
                        channel.send(self.rounds.handle(message))
                    else:
                        channel.send({"ok": False, "error": f"unknown op {op!r}"})
        except (ConnectionError, OSError, ValueError) as exc:
            logger.debug("replication connection from %s ended: %s", address, exc)
        finally:
            self._connections.release()

    def _receive(self, channel: Channel, head: dict[str, Any], node: int) -> None:
        try:
            rank = int(head["rank"])
            step, seq, nbytes = check_head(head)
            kept = self.rounds.kept if self.rounds is not None else None
            slot = self.store.begin(rank, step, seq, int(head["meta_crc"]), nbytes, keep=kept)
        except ReplicaSkipped as exc:
            if str(exc) != "held":
                logger.warning("the replica of rank %s step %s from node %d is skipped: %s", head.get("rank"),
                               head.get("step"), node, exc)
            channel.send({"accept": False, "reason": str(exc)})
            return
        except (KeyError, ValueError, TypeError) as exc:
            channel.send({"accept": False, "reason": f"bad request: {exc}"})
            return
        candidates = (replica_reuse.local_candidates(self.run_dir, step)
                      if replica_reuse.enabled() and self._local_crcs.worth_comparing(node, rank) else [])
        channel.send({"accept": True, "compare": bool(candidates)})
        try:  # TCP guards the transfer; the sender's checksum is kept, and every restore verifies it
            if candidates:  # this node's own snapshots of the step may hold the same bytes
                parts = [replica_reuse.Piece.from_list(p) for p in channel.recv()["pieces"]]
                reused = self._local_crcs.reuse(slot, parts, candidates, source=(node, rank))
                channel.send({"reused": sorted(reused)})
                replica_reuse.recv_pieces(channel.recv_into, slot, parts, reused)
            else:
                recv_range(channel.recv_into, slot, HEADER_SIZE, nbytes, checksum=False)
            trailer = channel.recv()
        except BaseException:  # the sender went away mid-copy: the previous replica stays
            self.store.abandon(slot, rank)
            raise
        if not trailer.get("intact") or not isinstance(trailer.get("crc"), int):
            self.store.abandon(slot, rank)
            channel.send({"ok": False, "error": "the copy was discarded: its source changed while it was read"})
            return
        try:
            self.store.publish(slot, rank, head, trailer["crc"], node)
        except CorruptCheckpointError as exc:
            channel.send({"ok": False, "error": f"the copy was discarded: {exc}"})
            return
        logger.debug("holding rank %d step %d from node %d (%d bytes)", rank, step, node, nbytes)
        channel.send({"ok": True})

    def _serve_fetch(self, channel: Channel, message: dict[str, Any]) -> None:
        rank, step, seq = int(message["rank"]), int(message["step"]), int(message["seq"])
        slot = self.store.acquire(rank, step, seq)
        if slot is None:
            channel.send({"ok": False, "error": f"no complete replica of rank {rank} step {step} seq {seq} here"})
            return
        try:
            header, record = slot.read_header(), read_record(slot)
            head = head_of(header)
            channel.send({"ok": True, **head, "data_crc": record[1]})
            crc = send_range(channel.sock, slot, HEADER_SIZE, head["nbytes"])
            intact = same_snapshot(header, slot.read_header()) and read_record(slot) == record and crc == record[1]
            channel.send({"crc": crc, "intact": intact})
        finally:
            self.store.release(slot)

    def local_inventory(self) -> list[dict[str, Any]]:
        """The complete snapshots in this node's ranks' own slots (from their records in the run directory)."""
        return [{"rank": rank, "step": header.step, "seq": header.seq}
                for rank, _, header in replica_reuse.local_snapshots(self.run_dir)]

    # --- status ----------------------------------------------------------------------------

    def report(self, node: int, note: dict[str, Any], **outcome: Any) -> None:
        """Record the outcome of a copy to ``node`` (shown by ``flashckpt ls``)."""
        with self._status_lock:
            sent = self._status["sent"].setdefault(str(note["rank"]), {})
            sent[str(node)] = {"step": note["step"], "seq": note["seq"], "time": time.time(), **outcome}
            self._write_status()

    def _update_status(self, **fields: Any) -> None:
        with self._status_lock:
            self._status.update(fields)
            self._write_status()

    def _write_status(self) -> None:
        path = os.path.join(self.run_dir, STATUS_FILE)
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                json.dump(self._status, f)
            os.replace(path + ".tmp", path)


def receive_copy(channel: Channel, path: str, rank: int, head: dict[str, Any], expected_crc: int) -> int:
    """Receive a fetched copy into the rank's slot ``path`` (locked meanwhile), sealed only when whole."""
    step, seq, nbytes = check_head(head)
    slot = Slot.create_or_open(path, nbytes)
    slot.lock()
    try:
        slot.begin_write(step, seq)
        slot.mark_persist_requested(0)  # a restored snapshot is not one to persist again
        slot.mark_persist_done(0)
        crc = recv_range(channel.recv_into, slot, HEADER_SIZE, nbytes)
        trailer = channel.recv()
        if not trailer.get("intact") or trailer.get("crc") != crc or crc != expected_crc:
            slot.invalidate()
            raise CorruptCheckpointError(f"the copy of rank {rank} step {step} was torn or damaged; it is not used")
        try:
            meta = seal_copy(slot, head)
        except CorruptCheckpointError:
            slot.invalidate()
            raise
        if meta.get("rank") != rank:
            slot.invalidate()
            raise CorruptCheckpointError(f"the copy holds rank {meta.get('rank')}, not rank {rank}")
        slot.seal()
    finally:
        slot.unlock()
        slot.close()
    return nbytes


def survey(storage: Storage, job: str, secret: bytes, node_rank: int = -1) -> list[dict[str, Any]]:
    """Ask every published saver of ``job`` what it holds: one entry per node with its ``record``,
    ``state`` ("ok", "unreachable", "refused"), ``local`` and ``replicas`` (lists of dicts)."""
    records = peers.read_peers(storage, job)

    def ask(record: PeerRecord) -> dict[str, Any]:
        entry: dict[str, Any] = {"node_rank": record.node_rank, "record": asdict(record), "state": "ok",
                                 "local": [], "replicas": []}
        try:
            channel = peers.connect(record, secret, job, node_rank, timeout=10.0)
            with contextlib.closing(channel):
                channel.send({"op": "inventory"})
                answer = channel.recv()
            entry.update(local=answer.get("local", []), replicas=answer.get("replicas", []))
        except PeerAuthError as exc:
            logger.warning("%s", exc)
            entry.update(state="refused", error=str(exc))
        except (OSError, ConnectionError, ValueError) as exc:
            logger.info("the saver of node %d at %s is unreachable: %s", record.node_rank, record.address, exc)
            entry.update(state="unreachable", error=str(exc))
        return entry

    if not records:
        return []
    with ThreadPoolExecutor(min(16, len(records)), thread_name_prefix="replica-survey") as pool:
        return list(pool.map(ask, [records[k] for k in sorted(records)]))


def copy_duty() -> float:
    """The share of the time a saver's copies to one peer may take (``$FLASHCKPT_REPLICA_DUTY``,
    default 0.1; 1 copies back to back)."""
    return _share(knobs.REPLICA_DUTY, 0.1)


def cpu_share() -> float:
    """The share of a node's CPU time its saver's replication rounds may take (``$FLASHCKPT_REPLICA_CPU``,
    default 0.01): on a node whose CPUs all train, what replication costs the training steps."""
    return _share(knobs.REPLICA_CPU, 0.01)


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


class _Sender:
    """Streams the newest sealed snapshot of each rank to one peer node, on its own thread.

    Only the newest snapshot per rank waits: a newer one replaces one not yet sent. A failed copy
    (peer unreachable, refused, gone mid-copy) is retried with backoff, with the newest snapshot.
    Copies take at most ``duty`` of the time (:func:`copy_duty`): after one that took ``d`` seconds
    the next starts ``d * (1 / duty - 1)`` later, so that snapshots taken every step cost training
    a bounded share of the host, at the price of a replica that lags the newest snapshot.
    """

    def __init__(self, owner: Replication, node: int) -> None:
        self.owner = owner
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
                self.owner.report(self.node, note, ok=False, reason=reason)
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
            settings = self.owner.settings
            record = peers.read_peer(self.owner.storage(), settings.job, self.node)
            if record is None:
                raise ConnectionError(f"node {self.node} has published no saver")
            self._channel = peers.connect(record, self.owner._secret, settings.job, settings.node_rank,
                                          timeout=SEND_TIMEOUT_S)
        return self._channel

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _push(self, note: dict[str, Any]) -> None:
        slot = self._source(note["slot"])
        if slot is None or push_copy(self.owner, self.node, self._connect, slot, note) != "ok":
            return
        (logger.info if self._failing is not None or not self._succeeded else logger.debug)(
            "rank %s step %s is replicated on node %d", note["rank"], note["step"], self.node)
        self._failing, self._succeeded = None, True


def push_copy(owner: Replication, node: int, connect: Callable[[], Channel], slot: Slot, note: dict[str, Any], *,
              crc: int | None = None) -> str:
    """Copy the snapshot ``note`` names (rank, step, seq) from ``slot`` to node ``node``'s store;
    ``crc``: the data's crc32 when known (a sealed kept copy), so that a whole copy is not read twice.

    Returns ``"ok"`` (the peer holds it now), ``"held"`` (it did already), ``"overtaken"`` (the
    slot no longer holds it, or took a newer save while it was read: nothing is kept), or
    ``"refused: why"`` (skipped or not kept, reported); raises on a connection failure.
    """
    rank, step, seq = int(note["rank"]), int(note["step"]), int(note["seq"])
    header = slot.read_header()
    if header is None or header.state is not SlotState.COMPLETE or (header.step, header.seq) != (step, seq):
        return "overtaken"  # the slot took a newer save meanwhile: that one is offered too
    head = head_of(header)
    if head["nbytes"] > slot.size:
        raise CorruptCheckpointError(f"slot {slot.path} is smaller than its snapshot says")
    started = time.monotonic()
    channel = connect()
    channel.send({"op": "push", "rank": rank, **head})
    answer = channel.recv()
    if not answer.get("accept"):
        if answer.get("reason") == "held":
            return "held"
        logger.warning("node %d skipped the replica of rank %d step %d: %s", node, rank, step, answer.get("reason"))
        owner.report(node, note, ok=False, reason=f"skipped: {answer.get('reason')}")
        return f"refused: {answer.get('reason')}"
    if answer.get("compare"):  # the receiver holds snapshots of this step: send what it lacks
        parts = replica_reuse.pieces(slot, header, HEADER_SIZE, head["nbytes"])
        channel.send({"pieces": [p.to_list() for p in parts]})
        reused = set(channel.recv().get("reused", []))
        sent = replica_reuse.send_pieces(channel.sock, slot, parts, reused)
        crc = replica_reuse.whole_crc(parts)
    else:
        crc = send_range(channel.sock, slot, HEADER_SIZE, head["nbytes"], crc=crc)
        sent = head["nbytes"] - HEADER_SIZE
    intact = same_snapshot(header, slot.read_header())
    channel.send({"crc": crc, "intact": intact})
    result = channel.recv()
    if not intact:
        logger.debug("the copy of rank %d step %d was overtaken by a newer save; discarded", rank, step)
        return "overtaken"
    elapsed = time.monotonic() - started
    if not result.get("ok"):
        logger.warning("node %d did not keep rank %d step %d: %s", node, rank, step, result.get("error"))
        owner.report(node, note, ok=False, reason=result.get("error"))
        return f"refused: {result.get('error')}"
    owner.report(node, note, ok=True, seconds=round(elapsed, 4), bytes=head["nbytes"], sent=sent)
    logger.debug("rank %d step %d is on node %d (%.1f MiB in %.3fs, %.1f MiB of it sent)", rank, step, node,
                 head["nbytes"] / 2**20, elapsed, sent / 2**20)
    return "ok"
