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

_TORCH_STORAGE_ALIGNMENT = 64


class _ChecksumWriter:
    """File-like wrapper that counts what passes through it and checksums it on a helper thread.

    ``zlib.crc32`` releases the GIL, so the checksum runs beside the writes. Small chunks are
    copied before they are queued (the zip writer reuses its header buffers); large ones are
    views of the slot, which stays mapped and unchanged while the file is written.

    A write error is kept, not raised: torch's zip writer aborts the process when a write
    fails under it, so the error is raised by :meth:`finish` once the writer is done.
    """

    _COPY_BELOW = 1 << 20

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.size = 0
        self.error: OSError | None = None
        self.discarded = False
        self._crc = 0
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._checksum, name="flashckpt-crc32", daemon=True)
        self._thread.start()

    def _checksum(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._crc = zlib.crc32(chunk, self._crc)

    def discard(self) -> None:
        """Drop whatever is written from now on (the file is being abandoned)."""
        self.discarded = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.discarded:
            return len(view)
        self._chunks.put(bytes(view) if len(view) < self._COPY_BELOW else view)
        if self.error is None:
            try:
                self._f.write(view)
            except OSError as exc:
                self.error = exc
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> int:
        """Wait for the checksum, raise a kept write error, return the crc32."""
        self._chunks.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
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
    """Write the zip layout of ``torch.save`` (same records, same order)."""
    writer = torch._C.PyTorchFileWriter(out, False, _TORCH_STORAGE_ALIGNMENT)
    try:
        writer.write_record("data.pkl", pickle_bytes, len(pickle_bytes))
        writer.write_record(".format_version", "1", 1)
        alignment = str(_TORCH_STORAGE_ALIGNMENT)
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key in sorted(storages, key=int):
            offset, nbytes = regions[storages[key]]
            ready(storages[key])
            if nbytes:
                writer.write_record(f"data/{key}", slot.storage(offset, nbytes), nbytes)
            else:
                writer.write_record(f"data/{key}", b"", 0)
    except BaseException:
        # Finish the zip into the void: left unfinished, the writer would write (and abort
        # the process) when it is destroyed.
        out.discard()
        writer.write_end_of_file()
        raise
    writer.write_end_of_file()


class _SizingSink:
    """Counts the bytes a zip writer would produce; data records are skipped over, never read."""

    def __init__(self) -> None:
        self.pos = self.end = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.end + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def torch_file_size(pickle_len: int, nbytes: int) -> int:
    """Size of the file :func:`_write_torch` writes for one storage of ``nbytes`` (as ``torch.save``)."""
    sink = _SizingSink()
    writer = torch._C.PyTorchFileWriter(sink, False, _TORCH_STORAGE_ALIGNMENT)
    writer.write_record("data.pkl", b"\0" * pickle_len, pickle_len)
    writer.write_record(".format_version", "1", 1)
    alignment = str(_TORCH_STORAGE_ALIGNMENT)
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    writer.write_record_metadata("data/0", nbytes)
    writer.write_end_of_file()
    return sink.end


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
