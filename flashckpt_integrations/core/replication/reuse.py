"""Data-parallel reuse for peer replicas: a push sends only the bytes the receiver lacks.

Where data-parallel ranks hold identical tensors (DDP, DeepSpeed ZeRO-0, Megatron-LM without the
distributed optimizer), a rank's snapshot has, at the same offsets, the same bytes as the
snapshot of the same step that a rank on the receiving node took itself: the same state packs
into the same layout. The receiver then copies those bytes from its own slot into the replica,
and only what differs (the metadata, RNG states, unique shards) travels. Nothing is assumed:
each piece is reused only when its crc32 and its Adler-32 (64 bits together: shards of the same
shape at the same offset, as tensor-parallel ranks hold, must not pass for each other) equal the
sender's, and only when the local snapshot did not change while it was read (its header, before
and after, as every copy here).

Call order, for one ``push`` (:mod:`.transfer`; sender S, receiver R):

1. R, on the announcement: :func:`local_candidates` (its own ranks' complete snapshots of that
   step), unless :meth:`LocalCrcs.worth_comparing` says that comparing this sender's rank has
   lately found nothing. With a candidate, it answers ``accept`` with ``compare``; without, the
   copy goes whole.
2. S: :func:`pieces` cuts the snapshot at its tensor regions and checksums each piece in one
   pass, and sends the list; :func:`whole_crc` gives the crc32 of the whole copy from it.
3. R: :meth:`LocalCrcs.reuse` copies every matching piece from a candidate into the replica
   slot and answers the indices it reused (none, when a candidate changed meanwhile).
4. S: :func:`send_pieces` streams the other pieces; R: :func:`recv_pieces` writes them in place.

``$FLASHCKPT_REPLICA_REUSE=0`` turns it off on the receiving node (every copy goes whole).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ... import knobs
from ..._utils.faults import fault_point
from ...errors import CorruptCheckpointError, SharedMemoryError
from ..shm_buffer import Slot, SlotHeader, SlotState
from ..torchzip import crc32_combine
from .local import local_snapshots
from .store import same_snapshot
from .stream import chunks

MIN_PIECE = 4 << 10
"""Regions smaller than this travel with the bytes around them (not worth a comparison)."""
MAX_SKIPPED = 32
"""The most copies of one sender's rank that go whole, uncompared, after comparisons found nothing."""


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    crc: int
    adler: int
    reusable: bool
    """A tensor region, which the receiver may hold at the same offset."""

    def to_list(self) -> list[int]:
        return [self.offset, self.length, self.crc, self.adler, int(self.reusable)]

    @classmethod
    def from_list(cls, item: list[int]) -> Piece:
        offset, length, crc, adler, reusable = (int(v) for v in item)
        if offset < 0 or length < 0:
            raise ValueError(f"a piece at {offset} of {length} bytes")
        return cls(offset, length, crc, adler, bool(reusable))


def enabled() -> bool:
    return knobs.get(knobs.REPLICA_REUSE, "1") != "0"


# --- the sender ----------------------------------------------------------------------------


def pieces(slot: Slot, header: SlotHeader, start: int, end: int) -> list[Piece]:
    """``slot[start:end]`` cut at the snapshot's tensor regions, each piece with its crc32."""
    regions = sorted((int(o), int(n)) for o, n in slot.read_metadata(header).get("regions", []) if n >= MIN_PIECE)
    out: list[Piece] = []
    at = start
    for offset, length in regions:
        if offset < at or offset + length > end:
            continue  # overlapping or outside: left inside the pieces around it
        if offset > at:
            out.append(Piece(at, offset - at, *_sums(slot, at, offset - at), False))
        out.append(Piece(offset, length, *_sums(slot, offset, length), True))
        at = offset + length
    if end > at:
        out.append(Piece(at, end - at, *_sums(slot, at, end - at), False))
    return out


def whole_crc(parts: list[Piece]) -> int:
    """The crc32 of the pieces' bytes one after the other."""
    crc = 0
    for piece in parts:
        crc = crc32_combine(crc, piece.crc, piece.length)
    return crc


def send_pieces(sock: Any, slot: Slot, parts: list[Piece], reused: set[int]) -> int:
    """Stream the bytes of every piece not in ``reused``, in order; return how many were sent."""
    sent = 0
    for index, piece in enumerate(parts):
        if index in reused:
            continue
        for offset, n in chunks(piece.offset, piece.offset + piece.length):
            with slot.memoryview(offset, n) as view:
                sock.sendall(view)
        sent += piece.length
    return sent


# --- the receiver --------------------------------------------------------------------------


def local_candidates(run_dir: str, step: int) -> list[str]:
    """The slot files of this node's ranks that hold a complete snapshot of ``step``."""
    return [path for _, path, header in local_snapshots(run_dir) if header.step == step]


def recv_pieces(recv_into: Callable[[memoryview], None], slot: Slot, parts: list[Piece], reused: set[int]) -> int:
    """Receive the bytes of every piece not in ``reused`` into place; return how many arrived."""
    received = 0
    for index, piece in enumerate(parts):
        if index in reused:
            continue
        for offset, n in chunks(piece.offset, piece.offset + piece.length):
            with slot.memoryview(offset, n) as view:
                recv_into(view)
        if not received:
            fault_point("replica.receive")  # part of the copy is in place
        received += piece.length
    return received


class LocalCrcs:
    """Checksums of this node's own snapshots, by slot, seq and piece (each read once per snapshot,
    however many peers' replicas are compared with it), and what comparing each sender's rank has
    found so far. Thread-safe enough: a race computes twice.

    A comparison costs a checksum pass over the snapshot on both sides. Where a sender's rank
    holds bytes that no rank here holds (tensor- or pipeline-parallel peers, or unshared
    optimizer shards), each comparison that finds nothing makes the next 1, 2, 4, ... up to
    ``MAX_SKIPPED`` copies of that rank go whole without one (:meth:`worth_comparing`); a
    comparison that reuses anything starts the count again. Nothing is assumed either way: a
    skipped comparison only sends bytes that might have been reused.
    """

    def __init__(self) -> None:
        self._crcs: dict[str, tuple[int, dict[tuple[int, int], tuple[int, int]]]] = {}
        self._misses: dict[tuple[int, int], tuple[int, int]] = {}  # (node, rank) -> (misses in a row, to skip)

    def worth_comparing(self, node: int, rank: int) -> bool:
        """Whether the next copy of ``rank`` from ``node`` should be compared (see the class)."""
        misses, skip = self._misses.get((node, rank), (0, 0))
        if skip:
            self._misses[(node, rank)] = (misses, skip - 1)
            return False
        return True

    def _learn(self, source: tuple[int, int] | None, parts: list[Piece], reused: set[int]) -> None:
        if source is None:
            return
        if reused or not any(piece.reusable for piece in parts):
            self._misses.pop(source, None)
            return
        misses = self._misses.get(source, (0, 0))[0] + 1
        self._misses[source] = (misses, min(1 << (misses - 1), MAX_SKIPPED))

    def reuse(self, replica: Slot, parts: list[Piece], candidates: list[str],
              source: tuple[int, int] | None = None) -> set[int]:
        """Copy each reusable piece that a candidate holds (same offset, length and crc32) into
        ``replica``; the indices copied, or none when a candidate changed while it was read.
        ``source`` (the sender's node and rank) learns from the outcome (:meth:`worth_comparing`)."""
        reused: set[int] = set()
        opened: list[tuple[Slot, SlotHeader]] = []
        try:
            for path in candidates:
                with contextlib.suppress(SharedMemoryError, CorruptCheckpointError, OSError):
                    slot = Slot.attach(path)
                    if slot is None:
                        continue
                    header = slot.read_header()
                    if header is None or header.state is not SlotState.COMPLETE:
                        slot.close()
                        continue
                    opened.append((slot, header))
            for index, piece in enumerate(parts):
                if not piece.reusable or piece.offset + piece.length > replica.size:
                    continue
                for slot, header in opened:
                    if (piece.offset + piece.length <= slot.size
                            and self._sums(slot, header, piece) == (piece.crc, piece.adler)):
                        _copy(slot, replica, piece)
                        reused.add(index)
                        break
            if not all(same_snapshot(slot.read_header(), header) for slot, header in opened):
                return set()  # a save began in a candidate meanwhile: the copied bytes are not trusted
            self._learn(source, parts, reused)
            return reused
        finally:
            for slot, _ in opened:
                slot.close()

    def _sums(self, slot: Slot, header: SlotHeader, piece: Piece) -> tuple[int, int] | None:
        seq, known = self._crcs.get(slot.path, (None, {}))
        if seq != header.seq:
            known = {}
            self._crcs[slot.path] = (header.seq, known)
        key = (piece.offset, piece.length)
        if key not in known:
            sums = _sums(slot, piece.offset, piece.length)
            if not same_snapshot(slot.read_header(), header):
                return None  # changing under us: matches nothing
            known[key] = sums
        return known[key]


def _copy(source: Slot, target: Slot, piece: Piece) -> None:
    for offset, n in chunks(piece.offset, piece.offset + piece.length):
        with source.memoryview(offset, n) as src, target.memoryview(offset, n) as dst:
            dst[:] = src


def _sums(slot: Slot, offset: int, length: int) -> tuple[int, int]:
    """crc32 and Adler-32 of ``slot[offset:offset + length]``, in one pass."""
    crc, adler = 0, 1
    for at, n in chunks(offset, offset + length):
        with slot.memoryview(at, n) as view:
            crc = zlib.crc32(view, crc)
            adler = zlib.adler32(view, adler)
    return crc, adler
