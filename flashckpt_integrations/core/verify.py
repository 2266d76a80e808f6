"""Checksums of a memory snapshot's data: taken after the seal, checked while a restore copies.

A slot's header and metadata carry their own crc32 (see :mod:`.shm_buffer`); this module covers
the data. Every snapshot's metadata names a *checksum table* (``meta["checksums"]``) that sits
between the data and the metadata, so that every copy of the slot's bytes (a peer's replica, a
fetch back from it) carries it::

    offset  size   field
    0       8      magic  b"FCSUMS01"
    8       8      seq: the save counter of the snapshot the sums belong to
    16      4*n    one checksum per extent: every tensor region, then every file's blob
    16+4n   4      checksum of the bytes above

The checksum is CRC-32C (hardware, the ``crc32c`` package; about 12 GiB/s on one core here, 5x
``zlib.crc32``); where that package is missing, ``zlib.crc32`` (named ``"crc32"`` in the table's
entry, so a reader never mixes the two).

Call order:

1. save: :func:`place` gives the table's offset and the metadata's (the table is sized before
   the metadata is written); the metadata records ``checksums`` (:func:`describe`).
2. after the seal, off the training path: :meth:`Checksummer.schedule` computes every extent's
   sum on a helper thread and writes the table (:func:`write_table`), unless a save reuses the
   slot first (:meth:`Checksummer.release` stops it; the table then never matches). When the
   trainer dies before its helper got there (killed right after a save), the node's saver, which
   outlives it, sums what is left as soon as the rank's connection drops (:func:`sum_left_behind`),
   before it answers anything else, so a relaunched rank finds the table.
3. restore: :func:`open_check` reads the table of a complete slot, or raises
   :class:`UnverifiedSnapshotError` (no table: the process ended before it was written, or the
   slot predates checksums). :meth:`SnapshotCheck.check` verifies extents by a separate pass;
   :meth:`SnapshotCheck.fuse` pairs host copies with their region's sum so that the copy checks
   each chunk right after copying it (:func:`.restore.copy_on_host`).

Either way the sums are taken within milliseconds of the seal. A snapshot whose table is still
missing at restore time is never verified against sums computed then: the bytes may have sat
unguarded for as long as the restart took, so it counts as unverified and the restore uses the
next tier.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._utils.cpus import affinity_cpus
from .._utils.procs import pid_alive
from ..errors import CorruptCheckpointError
from .shm_buffer import Slot, SlotHeader, SlotState, complete_snapshot

if TYPE_CHECKING:
    import torch

try:  # hardware CRC-32C
    import crc32c as _crc32c

    ALGORITHM = "crc32c"

    def _update(data: Any, value: int) -> int:
        return _crc32c.crc32c(data, value)
except ImportError:  # pragma: no cover - the package is a dependency; a broken install still verifies
    ALGORITHM = "crc32"

    def _update(data: Any, value: int) -> int:
        return zlib.crc32(data, value)

logger = logging.getLogger(__name__)

MAGIC = b"FCSUMS01"
_HEAD = struct.Struct("<8sq")
_U32 = struct.Struct("<I")
PARALLEL_MIN_BYTES = 64 << 20
"""A check of fewer bytes than this runs on the calling thread alone."""
CHUNK = 1 << 20
"""Bytes checksummed (and, in a fused restore, copied) at a time: small enough to stay in cache."""


class UnverifiedSnapshotError(CorruptCheckpointError):
    """A complete snapshot without a checksum table of its own (it cannot be verified)."""


def checksum(data: Any, value: int = 0) -> int:
    """The snapshot checksum (:data:`ALGORITHM`) of ``data``, continuing ``value``."""
    return _update(data, value)


def table_size(extents: int) -> int:
    return _HEAD.size + 4 * extents + 4


def place(data_end: int, extents: int) -> tuple[int, int]:
    """``(table offset, metadata offset)`` for a snapshot whose data ends at ``data_end``."""
    table = data_end
    return table, (table + table_size(extents) + 63) // 64 * 64


def describe(table_offset: int, extents: int) -> dict[str, Any]:
    """The metadata entry that names a snapshot's checksum table."""
    return {"algorithm": ALGORITHM, "offset": table_offset, "count": extents}


def extents(meta: dict[str, Any]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of everything the table covers: the regions, then each file's blob."""
    return [(int(o), int(n)) for o, n in meta["regions"]] + [(int(f["blob"][0]), int(f["blob"][1]))
                                                              for f in meta["files"]]


def sum_range(slot: Slot, offset: int, nbytes: int, stop: Callable[[], bool] | None = None) -> int | None:
    """The checksum of ``slot[offset:offset + nbytes]``; ``None`` when ``stop()`` said so."""
    value = 0
    view = slot.memoryview(offset, nbytes)
    try:
        for start in range(0, nbytes, CHUNK):
            if stop is not None and stop():
                return None
            value = _update(view[start:start + CHUNK], value)
    finally:
        view.release()
    return value


def write_table(slot: Slot, offset: int, seq: int, sums: list[int]) -> None:
    body = _HEAD.pack(MAGIC, seq) + b"".join(_U32.pack(s) for s in sums)
    slot.write_blob(offset, body + _U32.pack(_update(body, 0)))


def read_table(slot: Slot, header: SlotHeader, meta: dict[str, Any]) -> list[int]:
    """The sums of a complete slot's snapshot; :class:`UnverifiedSnapshotError` when it has none."""
    entry = meta.get("checksums")
    if not isinstance(entry, dict):
        raise UnverifiedSnapshotError(f"slot {slot.path}: the snapshot of step {header.step} has no checksums "
                                      "(written by an older version)")
    if entry.get("algorithm") != ALGORITHM:
        raise UnverifiedSnapshotError(
            f"slot {slot.path}: step {header.step} was summed with {entry.get('algorithm')!r}, this process "
            f"computes {ALGORITHM!r} (install crc32c)")
    count = int(entry["count"])
    raw = slot.read_bytes(int(entry["offset"]), table_size(count))
    magic, seq = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or seq != header.seq or _U32.unpack_from(raw, len(raw) - 4)[0] != _update(raw[:-4], 0):
        raise UnverifiedSnapshotError(
            f"slot {slot.path}: the checksums of step {header.step} were never written (the process ended "
            "right after the snapshot was sealed) or were damaged")
    return [_U32.unpack_from(raw, _HEAD.size + 4 * i)[0] for i in range(count)]


TABLE_WAIT_S = 2.0
"""How long a snapshot sealed a moment ago may take to get its checksums (its trainer's helper, or
the saver once that trainer died, takes them within milliseconds) before it counts as unverified."""


def await_table(slot: Slot, header: SlotHeader, timeout: float) -> bool:
    """Whether the complete snapshot ``header`` in ``slot`` has its table, waiting up to
    ``timeout`` seconds for its trainer's helper (or the saver) to write it."""
    deadline = time.monotonic() + timeout
    meta = slot.read_metadata(header)
    while True:
        try:
            read_table(slot, header, meta)
            return True
        except UnverifiedSnapshotError:
            current = slot.read_header()
            if time.monotonic() > deadline or current is None or current.seq != header.seq \
                    or current.state is not SlotState.COMPLETE:
                return False
            time.sleep(0.01)


@dataclass
class SnapshotCheck:
    """Verification of one complete snapshot: its extents and their expected sums."""

    slot: Slot
    step: int
    extents: list[tuple[int, int]]
    sums: list[int]
    files: int
    """How many of the extents (the last ones) are files' blobs."""

    def check(self, indices: Iterable[int] | None = None) -> None:
        """Verify extents (all, or ``indices``) by a pass of their own, on up to 4 threads (the
        checksum releases the GIL; a restore holds training up, so the host's cores are idle);
        raises on a mismatch."""
        chosen = list(range(len(self.extents)) if indices is None else indices)
        total = sum(self.extents[i][1] for i in chosen)
        threads = min(4, affinity_cpus(), len(chosen)) if total >= PARALLEL_MIN_BYTES else 1
        groups: list[list[int]] = [[] for _ in range(max(threads, 1))]
        loads = [0] * len(groups)
        for index in sorted(chosen, key=lambda i: -self.extents[i][1]):  # biggest first, to the lightest group
            lightest = loads.index(min(loads))
            groups[lightest].append(index)
            loads[lightest] += self.extents[index][1]
        failed: list[int] = []

        def run(group: list[int]) -> None:
            for index in group:
                if failed:
                    return
                offset, nbytes = self.extents[index]
                if sum_range(self.slot, offset, nbytes) != self.sums[index]:
                    failed.append(index)
                    return

        helpers = [threading.Thread(target=run, args=(g,), name="flashckpt-verify", daemon=True) for g in groups[1:]]
        for helper in helpers:
            helper.start()
        run(groups[0])
        for helper in helpers:
            helper.join()
        if failed:
            raise self.mismatch(failed[0])

    def mismatch(self, index: int) -> CorruptCheckpointError:
        offset, nbytes = self.extents[index]
        return CorruptCheckpointError(
            f"slot {self.slot.path}: bytes [{offset}, {offset + nbytes}) of the snapshot of step {self.step} "
            "differ from the checksum taken when it was saved")

    def blobs(self) -> range:
        """The indices of the files' blobs (checked before they are unpickled)."""
        return range(self.regions, len(self.extents))

    @property
    def regions(self) -> int:
        return len(self.extents) - self.files

    def fuse(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], base: int
             ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, Any]], list[int]]:
        """Pair each host copy whose source is exactly one region of the slot (mapped at ``base``)
        with a check of that region; return the copies (``(target, source, check or None)``) and
        the regions no copy covers whole (the caller checks those with :meth:`check`)."""
        by_address = {base + offset: index for index, (offset, _) in enumerate(self.extents[:self.regions])}
        covered: set[int] = set()
        out: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        for target, source in pairs:
            index = by_address.get(source.data_ptr())
            nbytes = source.numel() * source.element_size()
            if (index is not None and index not in covered and source.is_contiguous() and target.is_contiguous()
                    and nbytes == self.extents[index][1]):
                covered.add(index)
                out.append((target, source, _RegionCheck(self, index)))
            else:
                out.append((target, source, None))
        rest = [i for i in range(self.regions) if i not in covered]
        return out, rest


@dataclass
class _RegionCheck:
    """What a fused copy checks its running sum against once a region is copied."""

    check: SnapshotCheck
    index: int

    @property
    def expected(self) -> int:
        return self.check.sums[self.index]

    def failed(self) -> CorruptCheckpointError:
        return self.check.mismatch(self.index)


def open_check(slot: Slot, header: SlotHeader, meta: dict[str, Any]) -> SnapshotCheck:
    """The verification of a complete slot's snapshot (raises when it has no valid table)."""
    spans = extents(meta)
    sums = read_table(slot, header, meta)
    if len(sums) != len(spans):
        raise UnverifiedSnapshotError(f"slot {slot.path}: step {header.step} has {len(sums)} checksums for "
                                      f"{len(spans)} extents")
    return SnapshotCheck(slot, header.step, spans, sums, len(meta["files"]))


class Checksummer:
    """Takes the checksums of sealed slots on one helper thread, in the order they were sealed."""

    def __init__(self, name: str = "flashckpt-checksum") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Slot, int, Callable[[], None] | None]] = deque()
        self._current: Slot | None = None
        self._current_job: tuple[int, Callable[[], None] | None] = (0, None)
        self._stop_current = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, slot: Slot, seq: int, then: Callable[[], None] | None = None) -> None:
        """Checksum ``slot``'s snapshot ``seq`` (sealed) and write its table, in the background;
        then call ``then()`` (e.g. offer the snapshot to the peers: a copy taken before the table
        is written could never be verified)."""
        with self._cond:
            if self._closed:
                return
            self._queue.append((slot, seq, then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def release(self, slot: Slot | None) -> list[tuple[int, Callable[[], None] | None]]:
        """Before a save rewrites or remaps ``slot``: drop its queued job, stop the running one.
        Returns the jobs ``(seq, then)`` left undone (a remap that keeps the snapshot schedules
        them again)."""
        if slot is None:
            return []
        with self._cond:
            dropped = [(seq, then) for s, seq, then in self._queue if s is slot]
            self._queue = deque(job for job in self._queue if job[0] is not slot)
            if self._current is slot:
                self._stop_current = True
                dropped.append(self._current_job)
            while self._current is slot:
                self._cond.wait()
        return dropped

    def wait(self) -> None:
        """Until every scheduled table is written (a load in this process verifies against them)."""
        with self._cond:
            while self._queue or self._current is not None:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._stop_current = self._current is not None
            self._cond.notify_all()
            while self._current is not None:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                slot, seq, then = self._queue.popleft()
                self._current, self._current_job, self._stop_current = slot, (seq, then), False
            try:
                if _sum_slot(slot, seq, lambda: self._stop_current) and then is not None:
                    then()
            except Exception as exc:  # a slot unmapped under it, a damaged header: it stays unverified
                logger.debug("checksums of %s (seq %d) not written: %s", slot.path, seq, exc)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()


def _sum_slot(slot: Slot, seq: int, stop: Callable[[], bool]) -> bool:
    """Write the table of snapshot ``seq`` in ``slot``; whether it was written."""
    header = slot.read_header()
    if header is None or header.state is not SlotState.COMPLETE or header.seq != seq:
        return False
    meta = slot.read_metadata(header)
    entry = meta.get("checksums")
    if not isinstance(entry, dict):
        return False
    sums = []
    for offset, nbytes in extents(meta):
        value = sum_range(slot, offset, nbytes, stop)
        if value is None:
            return False
        sums.append(value)
    header = slot.read_header()  # still the same snapshot: a save that reuses the slot stops us first
    if header is None or header.seq != seq or header.state is not SlotState.COMPLETE or stop():
        return False
    write_table(slot, int(entry["offset"]), seq, sums)
    return True


def writer_identity() -> dict[str, Any]:
    """Who writes a process's snapshots (``meta["writer"]``): its pid and a token of its own, so
    a saver can tell a dead writer's slot from one a live process (even one that reuses the
    pid) may be writing."""
    return {"pid": os.getpid(), "token": uuid.uuid4().hex}


def writer_gone(writer: Any, *, hello: Mapping[str, Any] | None = None, dropped: Any = None) -> bool:
    """Whether the process that wrote a snapshot (its ``meta["writer"]``) is gone. ``hello``: the
    identity a rank's new process just sent (its own snapshots are not gone; an earlier process
    with the same pid is). ``dropped``: the identity of a rank whose connection just dropped."""
    if not isinstance(writer, Mapping) or not isinstance(writer.get("pid"), int):
        return dropped is not None  # written before writers were recorded: only a drop vouches
    if dropped is not None and writer.get("token") == dropped.get("token"):
        return True
    if hello is not None and writer.get("token") == hello.get("token"):
        return False
    if hello is not None and writer["pid"] == hello.get("pid"):
        return True
    return not pid_alive(writer["pid"])


def sum_left_behind(path: str, gone: Callable[[Any], bool]) -> bool:
    """Write the table of the complete snapshot in slot ``path`` if its writer died before it did
    (``gone(meta["writer"])``; the saver, when a rank's connection drops or a rank's new process
    says hello); whether a table was written. A live writer's slot is never touched: it may be
    reusing it (a table written then would land in its new snapshot)."""
    try:
        with complete_snapshot(path) as found:
            if found is None:
                return False
            slot, header, meta = found
            if not isinstance(meta.get("checksums"), dict) or not gone(meta.get("writer")):
                return False
            try:
                read_table(slot, header, meta)
                return False  # summed already
            except UnverifiedSnapshotError:
                pass
            _sum_slot(slot, header.seq, lambda: False)
            return True
    except CorruptCheckpointError as exc:
        logger.warning("the snapshot in %s cannot be summed: %s", path, exc)
        return False


def check_slot(path: str) -> dict[str, Any]:
    """What a restore would find in slot ``path`` (the trainer's or a replica): ``status`` ``"ok"``
    (every byte matches its checksum), ``"bad"`` (a mismatch: ``detail`` says where),
    ``"unverified"`` (no checksums), ``"incomplete"`` (torn or being written) or ``"empty"``."""
    slot = Slot.attach(path)
    if slot is None:
        return {"status": "empty", "step": None, "detail": None}
    try:
        return check_attached(slot)
    finally:
        slot.close()


def check_attached(slot: Slot) -> dict[str, Any]:
    """:func:`check_slot` of a slot the caller has mapped (and keeps, to read what verified)."""
    header = slot.read_header()
    if header is None or header.state is SlotState.EMPTY:
        return {"status": "empty", "step": None, "detail": None}
    if header.state is not SlotState.COMPLETE:
        return {"status": "incomplete", "step": header.step, "detail": "being written, or torn by a crash"}
    try:
        meta = slot.read_metadata(header)
        check = open_check(slot, header, meta)
    except UnverifiedSnapshotError as exc:
        return {"status": "unverified", "step": header.step, "detail": str(exc)}
    except CorruptCheckpointError as exc:
        return {"status": "bad", "step": header.step, "detail": str(exc)}
    try:
        check.check()
    except CorruptCheckpointError as exc:
        return {"status": "bad", "step": header.step, "detail": str(exc)}
    return {"status": "ok", "step": header.step, "detail": None}
