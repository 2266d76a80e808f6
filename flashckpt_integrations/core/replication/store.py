"""Replica slots: the copies of other nodes' snapshots that a saver keeps in its own shared memory.

A replica slot is a slot (:mod:`~flashckpt_integrations.core.shm_buffer`): the same header, step,
seq, metadata and metadata checksum as the rank's own slot it copies, byte for byte from offset
``HEADER_SIZE`` to the end of the metadata. Its persist fields are zero (a replica is never
persisted from), and a replica record in the header's spare bytes (offset 256) carries a
generation (which of a rank's two replicas is newer), the crc32 of the copied bytes as the sender
read them from its source, and the node the copy came from. A restore's fetch checks that crc
twice: the holder while it reads its replica (damage at rest or in the first transfer), the
fetching node while it receives (the second). Names::

    <shm dir>/flashckpt-<uid>-<job>.replica-r<rank>-<k>      k = 0, 1

Two per rank, written alternately: a copy goes into the slot without the newest complete replica,
in the writing state, and is sealed only once every byte arrived and the sender said that its
source did not change while it was read (see :func:`.stream.send_range`); so a receiver killed
mid-copy leaves the previous replica loadable and the torn one in the writing state, never loaded.

Call order (:mod:`.transfer`, on a saver): :meth:`ReplicaStore.begin` (choose and size the slot,
or :class:`ReplicaSkipped` with the reason) -> :func:`.stream.recv_range` ->
:meth:`ReplicaStore.publish` or :meth:`ReplicaStore.abandon`; for restores
:meth:`ReplicaStore.acquire` -> :func:`.stream.send_range` -> :meth:`ReplicaStore.release`; a
round's own copy (:mod:`.rounds`) goes in through :meth:`ReplicaStore.copy_local`. No torch here.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ... import knobs
from ...errors import CorruptCheckpointError, SharedMemoryError
from ..shm_buffer import GROWTH, HEADER_SIZE, Slot, SlotHeader, SlotState, shm_free_bytes
from .stream import chunks

logger = logging.getLogger(__name__)

REPLICAS_PER_RANK = 2
_RECORD_OFFSET = 256
_RECORD = struct.Struct("<8sqIi")
_RECORD_MAGIC = b"FCREPLIC"
_NAME_RE = re.compile(r"\.replica-r(\d+)-(\d+)$")


class ReplicaSkipped(Exception):
    """A replica was not taken (not enough shared memory, already held, busy): the reason."""


@dataclass(frozen=True)
class ReplicaInfo:
    """One complete, checksum-verified replica."""

    rank: int
    index: int
    path: str
    step: int
    seq: int
    generation: int
    data_crc: int
    from_node: int
    nbytes: int
    world_size: int | None
    tag: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "seq": self.seq, "generation": self.generation,
                "from_node": self.from_node, "bytes": self.nbytes, "world_size": self.world_size, "tag": self.tag}


def replica_path(shm_dir: str, job: str, rank: int, index: int) -> str:
    return os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{job}.replica-r{rank}-{index}")


def replica_paths(shm_dir: str, job: str) -> dict[int, list[str]]:
    """The replica slot files of ``job`` in ``shm_dir``, by rank."""
    found: dict[int, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{job}.replica-r*-*"))):
        match = _NAME_RE.search(path)
        if match:
            found.setdefault(int(match.group(1)), []).append(path)
    return found


def read_record(slot: Slot) -> tuple[int, int, int] | None:
    """``(generation, data crc, from node)`` of a replica slot, or None for none."""
    magic, generation, crc, node = _RECORD.unpack(slot.read_bytes(_RECORD_OFFSET, _RECORD.size))
    return (generation, crc, node) if magic == _RECORD_MAGIC else None


def describe(slot: Slot, rank: int, index: int) -> ReplicaInfo | None:
    """The complete replica in ``slot``, or None (empty, being written, or not verifiable)."""
    try:
        header = slot.read_header()
        record = read_record(slot)
        if header is None or header.state is not SlotState.COMPLETE or record is None:
            return None
        meta = slot.read_metadata(header)
    except CorruptCheckpointError as exc:
        logger.warning("ignoring replica slot %s: %s", slot.path, exc)
        return None
    return ReplicaInfo(rank, index, slot.path, header.step, header.seq, record[0], record[1], record[2],
                       header.meta_offset + header.meta_len, meta.get("world_size"), meta.get("tag"))


def list_replicas(shm_dir: str, job: str) -> list[ReplicaInfo]:
    """Every complete replica of ``job`` in ``shm_dir`` (for ``flashckpt ls``: reads, never writes)."""
    found = []
    for rank, paths in replica_paths(shm_dir, job).items():
        for path in paths:
            index = int(_NAME_RE.search(path).group(2))
            try:
                slot = Slot.attach(path)
            except SharedMemoryError:
                continue
            if slot is None:
                continue
            try:
                info = describe(slot, rank, index)
            finally:
                slot.close()
            if info is not None:
                found.append(info)
    return found


class ReplicaStore:
    """The saver's replica slots of one job (thread-safe: every receiving and serving thread)."""

    def __init__(self, shm_dir: str, job: str) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self._lock = threading.Lock()
        self._slots: dict[str, Slot] = {}
        self._readers: dict[str, int] = {}
        self._writing: set[int] = set()
        self._closed = False
        """Once closed (or removed at a clean end), a receive still running makes no new slot."""

    def _slot(self, path: str) -> Slot | None:
        slot = self._slots.get(path)
        if slot is not None and (slot.replaced() or slot.file_size() != slot.size):
            slot.close()
            del self._slots[path]
            slot = None
        if slot is None:
            slot = Slot.attach(path)
            if slot is not None:
                self._slots[path] = slot
        return slot

    def _infos(self, rank: int) -> list[ReplicaInfo | None]:
        infos = []
        for index in range(REPLICAS_PER_RANK):
            slot = self._slot(replica_path(self.shm_dir, self.job, rank, index))
            infos.append(describe(slot, rank, index) if slot is not None else None)
        return infos

    def inventory(self) -> list[dict[str, Any]]:
        """Every complete replica held, as JSON-ready dicts."""
        with self._lock:
            ranks = sorted(replica_paths(self.shm_dir, self.job))
            return [info.to_dict() for rank in ranks for info in self._infos(rank) if info is not None]

    def held(self, rank: int) -> list[ReplicaInfo]:
        """The complete replicas of rank ``rank``."""
        with self._lock:
            return [info for info in self._infos(rank) if info is not None]

    def begin(self, rank: int, step: int, seq: int, meta_crc: int, nbytes: int, *, keep: int | None = None) -> Slot:
        """The slot to copy rank ``rank``'s snapshot into, sized and marked as being written.

        ``keep``: the job's kept step (:mod:`.rounds`); its replica is never the one
        overwritten, even when it is the newer of the two."""
        with self._lock:
            if rank in self._writing:
                raise ReplicaSkipped(f"a replica of rank {rank} is being received already")
            for info in self._infos(rank):
                if info is not None and (info.step, info.seq) == (step, seq):
                    raise ReplicaSkipped("held")
            slot = self._sized(self._next_path(rank, keep), nbytes)
            if not slot.try_lock():  # held while another process persists it (flashckpt persist --from-replicas)
                raise ReplicaSkipped(f"the older replica of rank {rank} is being persisted")
            slot.begin_write(step, seq)
            slot.mark_persist_requested(0)
            slot.mark_persist_done(0)
            slot.write_blob(_RECORD_OFFSET, b"\0" * _RECORD.size)
            self._writing.add(rank)
            return slot

    def prepare(self, rank: int, nbytes: int, *, keep: int | None = None) -> None:
        """Make (and fault in) the slot the next copy of rank ``rank`` goes to, ``nbytes`` long,
        ahead of the copy (:class:`ReplicaSkipped` when it cannot be had now)."""
        with self._lock:
            if rank not in self._writing:
                self._sized(self._next_path(rank, keep), nbytes)

    def _next_path(self, rank: int, keep: int | None) -> str:
        """The slot a new copy of rank ``rank`` overwrites: the older, never the kept step's."""
        complete = [i for i in self._infos(rank) if i is not None]
        newest = max(complete, key=lambda i: i.generation).index if complete else None
        kept = {i.index for i in complete if keep is not None and i.step == keep}
        order = [k for k in range(REPLICAS_PER_RANK) if k != newest and k not in kept]
        order += [k for k in range(REPLICAS_PER_RANK) if k == newest and k not in kept]
        if not order:
            raise ReplicaSkipped(f"every replica slot of rank {rank} holds the kept step {keep}")
        path = replica_path(self.shm_dir, self.job, rank, order[0])
        if self._readers.get(path):
            raise ReplicaSkipped(f"the older replica of rank {rank} is being read by a restore")
        return path

    def _sized(self, path: str, nbytes: int) -> Slot:
        if self._closed:
            raise ReplicaSkipped("the replica store is closed (the job is ending)")
        slot = self._slot(path)
        have = slot.size if slot is not None else 0
        grow = max(0, int(nbytes * GROWTH) - have) if nbytes > have else 0
        free = shm_free_bytes(self.shm_dir)
        reserve = shm_reserve(self.shm_dir)
        if grow and free - grow < reserve:
            raise ReplicaSkipped(
                f"not enough shared memory in {self.shm_dir}: the replica needs {grow} more bytes, {free} are "
                f"free and {reserve} stay reserved (${knobs.REPLICA_SHM_RESERVE}); give /dev/shm more room or "
                "lower the replica count")
        try:
            if slot is None:
                slot = Slot.create_or_open(path, nbytes)
                self._slots[path] = slot
            else:
                slot.ensure_size(nbytes)
        except SharedMemoryError as exc:
            raise ReplicaSkipped(str(exc)) from exc
        return slot

    def publish(self, slot: Slot, rank: int, head: dict[str, Any], data_crc: int, from_node: int) -> None:
        """Seal a fully received replica once its metadata checks out (else it is abandoned)."""
        try:
            meta = seal_copy(slot, head)
            if meta.get("rank") != rank or meta.get("job") != self.job:
                raise CorruptCheckpointError(f"the copy names rank {meta.get('rank')} of job {meta.get('job')}, "
                                             f"expected rank {rank} of job {self.job}")
            with self._lock:
                generation = max((i.generation for i in self._infos(rank) if i is not None), default=0) + 1
                slot.write_blob(_RECORD_OFFSET, _RECORD.pack(_RECORD_MAGIC, generation, data_crc, from_node))
                slot.seal()
        except BaseException:
            self.abandon(slot, rank)
            raise
        slot.unlock()
        with self._lock:
            self._writing.discard(rank)

    def copy_local(self, rank: int, source: Slot, header: SlotHeader, from_node: int, *,
                   keep: int | None = None, give_way: Callable[[], bool] | None = None,
                   let_go: Callable[[], None] | None = None) -> bool:
        """Copy this node's own snapshot ``header`` of rank ``rank`` from its slot ``source`` into
        the store (a replica of the node's own rank, kept for the job's round). False when the
        slot takes a newer save while it is read, or when ``give_way()`` turns true (a save waits
        for the slot): the copy stops at the next piece and is dropped.

        The store's slot is made (and its pages faulted in) before the first ``give_way()``,
        which may take the source's lock, and ``let_go()`` is called as soon as the bytes are
        copied: the source is held for one memory copy, and the copy's crc32 is taken from the
        store's private copy afterwards."""
        head = head_of(header)
        try:
            slot = self.begin(rank, header.step, header.seq, header.meta_crc, head["nbytes"], keep=keep)
        except ReplicaSkipped as exc:
            if str(exc) == "held":
                return True
            raise
        try:
            intact = True
            for offset, n in chunks(HEADER_SIZE, head["nbytes"]):
                if (give_way is not None and give_way()) or not same_snapshot(header, source.read_header()):
                    intact = False
                    break
                with source.memoryview(offset, n) as src, slot.memoryview(offset, n) as dst:
                    dst[:] = src
            intact = intact and same_snapshot(header, source.read_header())
            if let_go is not None:
                let_go()
            crc = 0
            if intact:
                for offset, n in chunks(HEADER_SIZE, head["nbytes"]):
                    with slot.memoryview(offset, n) as view:
                        crc = zlib.crc32(view, crc)
        except BaseException:
            self.abandon(slot, rank)
            raise
        if not intact:
            self.abandon(slot, rank)
            return False
        self.publish(slot, rank, head, crc, from_node)
        return True

    def abandon(self, slot: Slot, rank: int) -> None:
        slot.invalidate()
        slot.unlock()
        with self._lock:
            self._writing.discard(rank)

    def acquire(self, rank: int, step: int, seq: int) -> Slot | None:
        """The complete replica of ``(rank, step, seq)``, held against being overwritten until released."""
        with self._lock:
            for info in self._infos(rank):
                if info is not None and (info.step, info.seq) == (step, seq):
                    self._readers[info.path] = self._readers.get(info.path, 0) + 1
                    return self._slots[info.path]
        return None

    def release(self, slot: Slot) -> None:
        with self._lock:
            self._readers[slot.path] -= 1

    def remove_all(self) -> None:
        """Unlink every replica slot of the job (the job ended cleanly)."""
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
            for paths in replica_paths(self.shm_dir, self.job).values():
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()


def verify(path: str) -> str | None:
    """Why the replica in slot ``path`` cannot be used (not complete, damaged), or None when its
    bytes match the checksum its sender computed. Reads the whole copy."""
    slot = Slot.attach(path)
    if slot is None:
        return f"{path} is gone"
    try:
        header, record = slot.read_header(), read_record(slot)
        if header is None or header.state is not SlotState.COMPLETE or record is None:
            return f"{path} holds no complete replica"
        nbytes = head_of(header)["nbytes"]
        crc = 0
        for offset, n in chunks(HEADER_SIZE, nbytes):
            with slot.memoryview(offset, n) as view:
                crc = zlib.crc32(view, crc)
        if crc != record[1] or not same_snapshot(header, slot.read_header()):
            return f"{path}: the replica of step {header.step} is damaged (its checksum does not match)"
        return None
    except CorruptCheckpointError as exc:
        return f"{path}: {exc}"
    finally:
        slot.close()


def shm_reserve(shm_dir: str) -> int:
    """Bytes of ``shm_dir`` that replicas leave free (``$FLASHCKPT_REPLICA_SHM_RESERVE``, else 10%)."""
    explicit = knobs.get(knobs.REPLICA_SHM_RESERVE)
    if explicit:
        return int(float(explicit))
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize // 10


def head_of(header: SlotHeader) -> dict[str, Any]:
    """What a receiver needs to know before the bytes of a slot arrive."""
    return {"step": header.step, "seq": header.seq, "meta_offset": header.meta_offset,
            "meta_len": header.meta_len, "meta_crc": header.meta_crc,
            "nbytes": header.meta_offset + header.meta_len}


def same_snapshot(a: SlotHeader | None, b: SlotHeader | None) -> bool:
    """The two headers describe the same complete snapshot (persist fields aside)."""
    return (a is not None and b is not None and a.state is SlotState.COMPLETE and b.state is SlotState.COMPLETE
            and (a.step, a.seq, a.meta_offset, a.meta_len, a.meta_crc)
            == (b.step, b.seq, b.meta_offset, b.meta_len, b.meta_crc))


def check_head(head: dict[str, Any], limit: int = 1 << 44) -> tuple[int, int, int]:
    """``(step, seq, nbytes)`` of a peer's announced copy, or ``ValueError`` when it makes no sense."""
    step, seq, offset, length, nbytes = (int(head[k]) for k in ("step", "seq", "meta_offset", "meta_len", "nbytes"))
    if offset < HEADER_SIZE or length <= 0 or offset + length != nbytes or nbytes > limit:
        raise ValueError(f"a copy of {nbytes} bytes with metadata at [{offset}, {offset + length}) makes no sense")
    return step, seq, nbytes


def seal_copy(slot: Slot, head: dict[str, Any]) -> dict[str, Any]:
    """Give a fully received copy its header (still writing) and check its metadata; returns it."""
    step, seq = int(head["step"]), int(head["seq"])
    offset, length = int(head["meta_offset"]), int(head["meta_len"])
    raw = slot.read_bytes(offset, length)
    if zlib.crc32(raw) != int(head["meta_crc"]):
        raise CorruptCheckpointError(f"the copy of step {step} has a metadata checksum mismatch")
    slot.write_metadata(step, seq, offset, raw)
    return slot.read_metadata(slot.read_header())
