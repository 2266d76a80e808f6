"""Streaming a slot's bytes over a peer channel, with their crc32 taken beside the transfer.

Every copy between savers moves a slot's bytes ``CHUNK`` at a time straight between its mapping
and the socket (:func:`send_range`, :func:`recv_range`); the replica store and the data-parallel
reuse walk slots in the same :func:`chunks`. No torch here.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..._utils.faults import fault_point
from ..shm_buffer import Slot

CHUNK = 4 << 20
"""Bytes per send/receive call (and per checksum update)."""


class _Checksum:
    """A crc32 over a slot's chunks in order, computed on a helper thread beside the transfer
    (``zlib`` and the socket calls both release the GIL: on a multi-core host they overlap)."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.crc = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="replica-crc")
        self._last: Future | None = None

    def add(self, offset: int, nbytes: int) -> None:
        self._last = self._pool.submit(self._update, offset, nbytes)

    def _update(self, offset: int, nbytes: int) -> None:
        with self.slot.memoryview(offset, nbytes) as view:
            self.crc = zlib.crc32(view, self.crc)

    def result(self) -> int:
        try:
            if self._last is not None:
                self._last.result()
            return self.crc
        finally:
            self._pool.shutdown(wait=True)


def chunks(start: int, end: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of the ``CHUNK``-sized pieces of ``[start, end)``, in order."""
    for offset in range(start, end, CHUNK):
        yield offset, min(CHUNK, end - offset)


def send_range(sock: Any, slot: Slot, start: int, end: int, *, crc: int | None = None) -> int:
    """Stream ``slot[start:end]`` to ``sock`` straight from the mapping; return its crc32 (``crc``
    when the caller knows it already: a sealed copy that nothing writes, whose checksum was taken
    as it was made, is not read a second time).

    The caller reads the slot's header before and after (a seqlock): the bytes count only if
    both say the same complete snapshot, so a save that reuses the slot meanwhile is detected and
    the copy discarded; the slot is never locked and a save never waits for a copy.
    """
    checksum = _Checksum(slot) if crc is None else None
    try:
        for offset, n in chunks(start, end):
            if checksum is not None:
                checksum.add(offset, n)
            with slot.memoryview(offset, n) as view:
                sock.sendall(view)
    finally:
        if checksum is not None:
            crc = checksum.result()
    return crc


def recv_range(recv_into: Callable[[memoryview], None], slot: Slot, start: int, end: int, *,
               checksum: bool = True) -> int | None:
    """Receive ``end - start`` bytes straight into ``slot[start:end]``; return their crc32 (None
    without ``checksum``: a replica keeps its sender's, which every restore verifies)."""
    crc = _Checksum(slot) if checksum else None
    try:
        for offset, n in chunks(start, end):
            with slot.memoryview(offset, n) as view:
                recv_into(view)
            if crc is not None:
                crc.add(offset, n)
            if offset == start:
                fault_point("replica.receive")  # part of the copy is in place
    finally:
        value = crc.result() if crc is not None else None
    return value
