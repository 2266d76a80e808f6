"""Codecs: write a file of a snapshot from shared memory to storage, and read files back.

Writing happens in the saver from the slot's metadata alone (no unpickling). Every file is
checksummed (crc32 of its bytes) while it is written; the checksum goes into the rank's done
marker and is verified when the file is read back through :func:`read_file`.
"""

from __future__ import annotations

import functools
import io
import json
import queue
import sys
import threading
import zlib
from collections.abc import Callable
from typing import IO, Any

import torch

from ..errors import CorruptCheckpointError
from .shm_buffer import Slot
from .state import SAFE_GLOBALS, Codec, rebuild_safetensors, tensor_part_pickle, unpickle_torch
from .storage import Storage
from .torchzip import TorchZipWriter, archive_size, crc32_combine

_TORCH_STORAGE_ALIGNMENT = 64


class _ChecksumWriter:
    """File-like wrapper that counts what passes through it and checksums it on a helper thread.

    ``zlib.crc32`` releases the GIL, so the checksum runs beside the writes. Small chunks are
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
                    self._crc = zlib.crc32(view, self._crc)
                else:
                    crc = zlib.crc32(view)
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
    writer = TorchZipWriter(out, alignment=_TORCH_STORAGE_ALIGNMENT, write_crc32=out.write_crc32)
    writer.write_record("data.pkl", pickle_bytes)
    writer.write_record(".format_version", "1")
    writer.write_record(".storage_alignment", str(_TORCH_STORAGE_ALIGNMENT))
    writer.write_record("byteorder", sys.byteorder)
    for key in sorted(storages, key=int):
        if out.error is not None:
            return  # the file is lost: write_file raises the error, no need to wait for the rest
        offset, nbytes = regions[storages[key]]
        ready(storages[key])  # the region is in the slot before any of it is read
        writer.write_record(f"data/{key}", slot.memoryview(offset, nbytes) if nbytes else b"")
    writer.finish()


@functools.lru_cache(maxsize=4096)
def torch_file_size(pickle_len: int, nbytes: int) -> int:
    """Size of the file :func:`_write_torch` writes for one storage of ``nbytes`` (as ``torch.save``)."""
    return archive_size([
        ("data.pkl", pickle_len), (".format_version", 1), (".storage_alignment", len(str(_TORCH_STORAGE_ALIGNMENT))),
        ("byteorder", len(sys.byteorder)), ("data/0", nbytes),
    ], alignment=_TORCH_STORAGE_ALIGNMENT)


def parts_layout(parts: list[Any]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each part in the file the parts codec writes for ``parts``."""
    out, offset = [], 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            length = torch_file_size(len(tensor_part_pickle(part)), part.numel() * part.element_size())
        else:
            length = memoryview(part).nbytes
        out.append((offset, length))
        offset += length
    return out


def decode_from_slot(
    slot: Slot,
    regions: list[list[int]],
    fmeta: dict[str, Any],
    *,
    weights_only: bool = True,
    map_location: Any = None,
    copy: bool = True,
) -> Any:
    """Rebuild one file's object from a complete slot."""
    codec = Codec(fmeta["codec"])
    blob = slot.read_bytes(*fmeta["blob"])
    if codec is Codec.TORCH:
        storages = fmeta["storages"]

        def storage_for_key(key: str) -> torch.UntypedStorage:
            if key not in storages:
                raise CorruptCheckpointError(f"{fmeta['path']}: pickle names storage {key} that the slot lacks")
            offset, nbytes = regions[storages[key]]
            return slot.storage(offset, nbytes) if nbytes else torch.UntypedStorage(0)

        return unpickle_torch(blob, storage_for_key, weights_only=weights_only, map_location=map_location, copy=copy)
    if codec is Codec.SAFETENSORS:
        views = [slot.view(*regions[i]) for i in fmeta["tensors"]]
        return rebuild_safetensors(blob, views, copy=copy)
    if codec is Codec.PARTS:
        return [blob[start:end] if region < 0 else unpickle_torch(
            blob[start:end], lambda _key, r=region: _region_storage(slot, regions, r), weights_only=weights_only,
            map_location=map_location, copy=copy) for start, end, region in fmeta.get("parts", [])]
    return _decode_small(codec, blob)


def _region_storage(slot: Slot, regions: list[list[int]], index: int) -> torch.UntypedStorage:
    offset, nbytes = regions[index]
    return slot.storage(offset, nbytes) if nbytes else torch.UntypedStorage(0)


def _decode_small(codec: Codec, data: bytes) -> Any:
    if codec is Codec.JSON:
        return json.loads(data)
    return data


def read_file(
    storage: Storage,
    path: str,
    codec: Codec,
    *,
    expected: dict[str, Any] | None = None,
    weights_only: bool = True,
    map_location: Any = None,
) -> Any:
    """Read a committed file through ``storage``; ``expected`` (a marker entry) is verified."""
    data = storage.read(path)
    if expected is not None:
        if len(data) != expected["size"] or zlib.crc32(data) != expected["crc32"]:
            raise CorruptCheckpointError(
                f"{path}: size/checksum {len(data)}/{zlib.crc32(data)} differ from the "
                f"{expected['size']}/{expected['crc32']} recorded when it was written; the file "
                "was changed or truncated after the commit"
            )
    codec = Codec(codec)
    if codec is Codec.TORCH:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    if codec is Codec.SAFETENSORS:
        from safetensors.torch import load as st_load

        return st_load(data)
    return _decode_small(codec, data)
