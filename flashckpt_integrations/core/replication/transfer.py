"""The copy mechanism between savers: a push, its receipt, a restore's fetch, the inventory.

Each runs on one authenticated channel (:class:`.peers.Channel`), its message named in
:data:`~flashckpt_integrations.core.protocol.PEER_OPS`:

- ``push`` (:func:`push_copy` on the sender, :meth:`PushReceiver.receive` on the receiver): the
  sender announces the copy (its :func:`.store.head_of`), the receiver accepts it into a replica
  slot or skips it with the reason, and asks to ``compare`` when its own ranks hold a snapshot of
  the same step (:mod:`.reuse`: only the pieces it lacks travel). The sender then streams the
  bytes and says whether its source stayed the same meanwhile (``intact``, with the crc32); the
  receiver seals the replica only then.
- ``fetch`` (:func:`fetch_replica` on the fetching node, :func:`serve_fetch` on the holder): one
  complete replica streamed back into a rank's own slot (:func:`receive_copy`), checked against
  the crc32 taken when it was made on both sides.
- ``inventory`` (:func:`survey` asks every published saver, :func:`inventory` answers).

The source slot is read optimistically, never locked: its header is read before and after the
bytes, and a copy whose source changed meanwhile is discarded. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from ...errors import CorruptCheckpointError
from ..protocol import PeerOp
from ..shm_buffer import HEADER_SIZE, Slot, SlotHeader, SlotState
from . import reuse
from .local import local_inventory
from .peers import Channel, PeerAuthError, PeerDialer, PeerRecord
from .status import StatusFile
from .store import ReplicaSkipped, ReplicaStore, check_head, head_of, read_record, same_snapshot, seal_copy
from .stream import recv_range, send_range

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
"""A peer that takes longer than this for one send or answer is given up (and retried later)."""
SURVEY_TIMEOUT_S = 10.0
"""How long one saver's inventory answer may take."""


# --- push: the sender ----------------------------------------------------------------------


def push_copy(status: StatusFile, node: int, connect: Callable[[], Channel], slot: Slot, note: dict[str, Any], *,
              crc: int | None = None) -> str:
    """Copy the snapshot ``note`` names (rank, step, seq) from ``slot`` to node ``node``'s store;
    ``crc``: the data's crc32 when known (a sealed kept copy), so that a whole copy is not read twice.
    Refusals and copies kept are reported to ``status``.

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
    channel.send({"op": PeerOp.PUSH, "rank": rank, **head})
    answer = channel.recv()
    if not answer.get("accept"):
        if answer.get("reason") == "held":
            return "held"
        logger.warning("node %d skipped the replica of rank %d step %d: %s", node, rank, step, answer.get("reason"))
        status.report(node, note, ok=False, reason=f"skipped: {answer.get('reason')}")
        return f"refused: {answer.get('reason')}"
    crc, sent = _send_bytes(channel, slot, header, head["nbytes"], crc, compare=bool(answer.get("compare")))
    intact = same_snapshot(header, slot.read_header())
    channel.send({"crc": crc, "intact": intact})
    result = channel.recv()
    if not intact:
        logger.debug("the copy of rank %d step %d was overtaken by a newer save; discarded", rank, step)
        return "overtaken"
    elapsed = time.monotonic() - started
    if not result.get("ok"):
        logger.warning("node %d did not keep rank %d step %d: %s", node, rank, step, result.get("error"))
        status.report(node, note, ok=False, reason=result.get("error"))
        return f"refused: {result.get('error')}"
    status.report(node, note, ok=True, seconds=round(elapsed, 4), bytes=head["nbytes"], sent=sent)
    logger.debug("rank %d step %d is on node %d (%.1f MiB in %.3fs, %.1f MiB of it sent)", rank, step, node,
                 head["nbytes"] / 2**20, elapsed, sent / 2**20)
    return "ok"


def _send_bytes(channel: Channel, slot: Slot, header: SlotHeader, nbytes: int, crc: int | None, *,
                compare: bool) -> tuple[int, int]:
    """Stream a copy's bytes: with ``compare`` (the receiver holds snapshots of this step) only the
    pieces it lacks, else all of them; ``(crc32 of the whole copy, bytes sent)``."""
    if not compare:
        return send_range(channel.sock, slot, HEADER_SIZE, nbytes, crc=crc), nbytes - HEADER_SIZE
    parts = reuse.pieces(slot, header, HEADER_SIZE, nbytes)
    channel.send({"pieces": [p.to_list() for p in parts]})
    reused = set(channel.recv().get("reused", []))
    sent = reuse.send_pieces(channel.sock, slot, parts, reused)
    return reuse.whole_crc(parts), sent


# --- push: the receiver --------------------------------------------------------------------


class PushReceiver:
    """The receiving side of ``push``: a peer's copy into the replica store, with the pieces that
    this node's own ranks hold taken from their slots (:mod:`.reuse`). ``kept()`` gives the step
    whose copies no write may overwrite (:meth:`.policy.CopyPolicy.kept`)."""

    def __init__(self, store: ReplicaStore, run_dir: str, kept: Callable[[], int | None]) -> None:
        self.store = store
        self.run_dir = run_dir
        self._kept = kept
        self._local_crcs = reuse.LocalCrcs()

    def receive(self, channel: Channel, head: dict[str, Any], node: int) -> None:
        """Serve one ``push`` from node ``node`` (``head``: its announcement)."""
        begun = self._begin(channel, head, node)
        if begun is None:
            return
        slot, rank = begun
        step, nbytes = int(head["step"]), int(head["nbytes"])
        candidates = (reuse.local_candidates(self.run_dir, step)
                      if reuse.enabled() and self._local_crcs.worth_comparing(node, rank) else [])
        channel.send({"accept": True, "compare": bool(candidates)})
        try:  # TCP guards the transfer; the sender's checksum is kept, and every restore verifies it
            if candidates:  # this node's own snapshots of the step may hold the same bytes
                parts = [reuse.Piece.from_list(p) for p in channel.recv()["pieces"]]
                reused = self._local_crcs.reuse(slot, parts, candidates, source=(node, rank))
                channel.send({"reused": sorted(reused)})
                reuse.recv_pieces(channel.recv_into, slot, parts, reused)
            else:
                recv_range(channel.recv_into, slot, HEADER_SIZE, nbytes, checksum=False)
            trailer = channel.recv()
        except BaseException:  # the sender went away mid-copy: the previous replica stays
            self.store.abandon(slot, rank)
            raise
        self._seal(channel, slot, rank, head, trailer, node)

    def _begin(self, channel: Channel, head: dict[str, Any], node: int) -> tuple[Slot, int] | None:
        """The slot the copy goes into and its rank; None when it is skipped (answered)."""
        try:
            rank = int(head["rank"])
            step, seq, nbytes = check_head(head)
            return self.store.begin(rank, step, seq, int(head["meta_crc"]), nbytes, keep=self._kept()), rank
        except ReplicaSkipped as exc:
            if str(exc) != "held":
                logger.warning("the replica of rank %s step %s from node %d is skipped: %s", head.get("rank"),
                               head.get("step"), node, exc)
            channel.send({"accept": False, "reason": str(exc)})
        except (KeyError, ValueError, TypeError) as exc:
            channel.send({"accept": False, "reason": f"bad request: {exc}"})
        return None

    def _seal(self, channel: Channel, slot: Slot, rank: int, head: dict[str, Any], trailer: dict[str, Any],
              node: int) -> None:
        """Keep the received copy when its sender says its source stayed intact; answer either way."""
        if not trailer.get("intact") or not isinstance(trailer.get("crc"), int):
            self.store.abandon(slot, rank)
            channel.send({"ok": False, "error": "the copy was discarded: its source changed while it was read"})
            return
        try:
            self.store.publish(slot, rank, head, trailer["crc"], node)
        except CorruptCheckpointError as exc:
            channel.send({"ok": False, "error": f"the copy was discarded: {exc}"})
            return
        logger.debug("holding rank %d step %d from node %d (%d bytes)", rank, int(head["step"]), node,
                     int(head["nbytes"]))
        channel.send({"ok": True})


# --- fetch ---------------------------------------------------------------------------------


def serve_fetch(channel: Channel, message: dict[str, Any], store: ReplicaStore) -> None:
    """The holder's side of ``fetch``: stream the replica ``(rank, step, seq)`` with its crc32."""
    rank, step, seq = int(message["rank"]), int(message["step"]), int(message["seq"])
    slot = store.acquire(rank, step, seq)
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
        store.release(slot)


def fetch_replica(dialer: PeerDialer, holder: PeerRecord, rank: int, step: int, seq: int, path: str) -> int:
    """Copy the replica ``(rank, step, seq)`` from ``holder`` into the rank's slot ``path``; its bytes."""
    channel = dialer.connect(holder, timeout=SEND_TIMEOUT_S)
    try:
        channel.send({"op": PeerOp.FETCH, "rank": rank, "step": step, "seq": seq})
        head = channel.recv()
        if not head.get("ok"):
            raise RuntimeError(f"node {holder.node_rank} has no such replica: {head.get('error')}")
        if check_head(head)[:2] != (step, seq):
            raise RuntimeError(f"node {holder.node_rank} answered with step {head['step']} seq {head['seq']}")
        return receive_copy(channel, path, rank, head, expected_crc=int(head["data_crc"]))
    finally:
        channel.close()


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


# --- inventory -----------------------------------------------------------------------------


def inventory(store: ReplicaStore, run_dir: str) -> dict[str, Any]:
    """The answer to ``inventory``: the replicas in ``store`` and this node's own complete snapshots."""
    return {"ok": True, "replicas": store.inventory(), "local": local_inventory(run_dir)}


def survey(dialer: PeerDialer) -> list[dict[str, Any]]:
    """Ask every published saver of the job what it holds: one entry per node with its ``record``,
    ``state`` ("ok", "unreachable", "refused"), ``local`` and ``replicas`` (lists of dicts)."""
    records = dialer.records()

    def ask(record: PeerRecord) -> dict[str, Any]:
        entry: dict[str, Any] = {"node_rank": record.node_rank, "record": asdict(record), "state": "ok",
                                 "local": [], "replicas": []}
        try:
            channel = dialer.connect(record, timeout=SURVEY_TIMEOUT_S)
            with contextlib.closing(channel):
                channel.send({"op": PeerOp.INVENTORY})
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
