"""Writing a snapshot's files from shared memory to storage, in the saver, without torch.

The saver writes every file from the slot's bytes and its metadata alone (no unpickling, no
torch import: it starts in a fraction of a second). Every file is checksummed (crc32 of its
bytes) while it is written; the checksum goes into the rank's done marker and is verified when
the file is read back (:func:`.codecs.read_file`).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from enum import Enum
from typing import IO, Any

from .._utils.crc32 import crc32
from .shm_buffer import Slot
from .storage import Storage
from .torchzip import TorchZipWriter, crc32_combine


class Codec(str, Enum):
    """How a file is encoded on storage."""

    TORCH = "torch"
    """``torch.save`` format (a zip with ``data.pkl``); loads with ``torch.load``."""
    SAFETENSORS = "safetensors"
    """A flat ``{name: tensor}`` dict in the safetensors format."""
    BYTES = "bytes"
    """Raw bytes, written as they are."""
    JSON = "json"
    """A JSON-serialisable object, written as UTF-8 JSON."""
    PARTS = "parts"
    """A list of parts written one after the other: ``bytes`` as they are, each tensor as the
    ``torch.save`` file of that tensor alone (contiguous, detached); the layout of
    ``torch.distributed.checkpoint``'s ``.distcp`` files. Read back from storage as bytes."""


TORCH_STORAGE_ALIGNMENT = 64


class _ChecksumWriter:
    """File-like wrapper that counts what passes through it and checksums it on a helper thread.

    ``crc32`` (:mod:`.._utils.crc32`) releases the GIL, so the checksum runs beside the writes. Small chunks are
    copied before they are queued (unless they are ``bytes``); large ones are views of the slot,
    which stays mapped and unchanged while the file is written. :meth:`write_crc32` also hands
    back a chunk's own CRC-32 (a zip record's), computed beside its write and folded into the
    file's with :func:`crc32_combine`, so the bytes are checksummed once.

    A write error is kept, not raised, and later writes are skipped: :meth:`finish` raises it.
    """

    _COPY_BELOW = 1 << 20

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.size = 0
        self.error: OSError | None = None
        self._crc = 0
        self._failed: Exception | None = None
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._checksum, name="flashckpt-crc32", daemon=True)
        self._thread.start()

    def _checksum(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            # (view, reply): the view's own CRC is wanted as well
            view, reply = chunk if isinstance(chunk, tuple) else (chunk, None)
            try:
                if self._failed is not None:
                    raise self._failed
                if reply is None:
                    self._crc = crc32(view, self._crc)
                else:
                    crc = crc32(view)
                    self._crc = crc32_combine(self._crc, crc, len(view))
                    reply.put(crc)
            except Exception as exc:  # keep draining: never leave a writer waiting for its reply
                self._failed = exc
                if reply is not None:
                    reply.put(exc)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._chunks.put(data if type(data) is bytes else bytes(view) if len(view) < self._COPY_BELOW else view)
        self._write(view)
        return len(view)

    def write_crc32(self, data: Any) -> int:
        """Write ``data`` and return its CRC-32, computed on the helper thread during the write."""
        view = memoryview(data).cast("B")
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._chunks.put((view, reply))
        self._write(view)
        crc = reply.get()
        if isinstance(crc, Exception):
            raise crc
        return crc

    def _write(self, view: memoryview) -> None:
        if self.error is None:
            try:
                self._f.write(view)
            except OSError as exc:
                self.error = exc
        self.size += len(view)

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> int:
        """Wait for the checksum, raise a kept write error, return the crc32."""
        self._chunks.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self._failed is not None:
            raise self._failed
        return self._crc


def write_file(
    storage: Storage, path: str, fmeta: dict[str, Any], regions: list[list[int]], slot: Slot,
    ready: Callable[[int], None] = lambda index: None,
) -> dict[str, Any]:
    """Write one file described by ``fmeta`` from ``slot``; return its marker entry.

    ``ready(i)`` returns once region ``i`` is in place in the slot (it may still be filling).
    """
    codec = Codec(fmeta["codec"])
    blob_off, blob_len = fmeta["blob"]
    with storage.open_write(path) as f:
        out = _ChecksumWriter(f)
        try:
            if codec is Codec.TORCH:
                _write_torch(out, slot, slot.read_bytes(blob_off, blob_len), fmeta["storages"], regions, ready)
            elif codec is Codec.PARTS:
                blob = slot.read_bytes(blob_off, blob_len)
                for start, end, region in fmeta.get("parts", []):
                    if region < 0:
                        out.write(blob[start:end])
                    else:
                        _write_torch(out, slot, blob[start:end], {"0": region}, regions, ready)
            else:
                out.write(slot.memoryview(blob_off, blob_len))
                for index in fmeta["tensors"]:
                    offset, nbytes = regions[index]
                    ready(index)
                    if nbytes:
                        out.write(slot.memoryview(offset, nbytes))
        finally:
            crc = out.finish()
    return {"path": path, "size": out.size, "crc32": crc}


def _write_torch(
    out: _ChecksumWriter, slot: Slot, pickle_bytes: bytes, storages: dict[str, int], regions: list[list[int]],
    ready: Callable[[int], None],
) -> None:
    """Write what ``torch.save`` writes (same records, same order, same bytes; see :mod:`.torchzip`)."""
    writer = TorchZipWriter(out, alignment=TORCH_STORAGE_ALIGNMENT, write_crc32=out.write_crc32)
    writer.write_record("data.pkl", pickle_bytes)
    writer.write_record(".format_version", "1")
    writer.write_record(".storage_alignment", str(TORCH_STORAGE_ALIGNMENT))
    writer.write_record("byteorder", sys.byteorder)
    for key in sorted(storages, key=int):
        if out.error is not None:
            return  # the file is lost: write_file raises the error, no need to wait for the rest
        offset, nbytes = regions[storages[key]]
        ready(storages[key])  # the region is in the slot before any of it is read
        writer.write_record(f"data/{key}", slot.memoryview(offset, nbytes) if nbytes else b"")
    writer.finish()
