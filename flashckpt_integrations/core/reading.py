"""One-pass reads of committed files: every byte read from storage once, front to back, in large
aligned reads, checksummed in the same pass; a ``torch.save`` archive is decoded straight into the
live tensors of a restore.

Call order::

    with open_ranges(storage, path) as ranges:   # the backend's ranged reader, or one over open_read
        obj = read_torch(ranges, path, expected=entry, target=live_obj)  # a torch archive
        data = read_bytes(ranges, path, expected=entry)                   # any other file
        # or, for a file of items (DCP's .distcp): in order, then the whole file's crc32
        source = Source(ranges, path, tail_start=ranges.size)
        source.take(offset, length, buffer); item = decode_torch(buffer, length, name)
        crc = source.finish(); source.close()
        read_range(ranges, path, offset, length, buffer)                 # one range, out of order

A thread reads ahead into page-aligned buffers (what ``O_DIRECT`` needs, see
:class:`.storage.LocalRanges`) while the caller's thread checksums each buffer and copies what it
holds to where it goes. :func:`read_torch` first reads the archive's central directory from the
end of the file (the one read that is not in order), then streams the rest: the pickle into
bytes, each storage into the target tensor that will receive it (when that tensor is the
storage's only view, of the same dtype, shape and size, contiguous on the host), every other
storage into a fresh host buffer; the pickle is then rebuilt over those buffers. The file's
size and crc32 are compared with its rank marker's (``expected``); a mismatch raises
:class:`~flashckpt_integrations.errors.CorruptCheckpointError`. Tensors written in place then
hold part of the bad file: callers pass ``target`` only where another tier can be restored over
it, as :mod:`.checkpointer.loading` does.

An archive this reader does not follow (a compressed record, the pickle after the storages,
another byte order) is read whole, still once, and handed to ``torch.load``.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import queue
import struct
import sys
import threading
import zipfile
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from .._utils.crc32 import crc32
from ..errors import CorruptCheckpointError
from .layout import checksum_mismatch
from .state import SAFE_GLOBALS, unpickle_torch
from .storage import Storage
from .torchzip import crc32_combine

CHUNK = 8 << 20
"""Bytes per read: large enough for the disk's bandwidth, small enough to stay near the caches."""
DEPTH = 4
"""Buffers in flight: one being copied out of, the rest read ahead."""
TAIL = 256 << 10
"""Bytes read from the end first; more when the central directory is larger."""
PAGE = mmap.PAGESIZE

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # the zip records, as .torchzip writes them
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50


class Ranges(Protocol):
    """A file opened for positioned reads (:meth:`.storage.LocalStorage.open_ranges`,
    :meth:`.storage.FsspecStorage.open_ranges`, or :class:`FileRanges`). An optional ``chunk``
    attribute sets the size of the sequential reads (``CHUNK`` without it)."""

    size: int
    align: int

    def readinto(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset`` (short only at the end of the file); the bytes read."""

    def close(self) -> None:
        """Release the file."""


def open_ranges(storage: Storage, path: str) -> Any:
    """``path`` of ``storage`` for positioned reads: the backend's own ranged reader where it has
    one (``open_ranges``), else :class:`FileRanges`. A context manager."""
    opener = getattr(storage, "open_ranges", None)
    return opener(path) if opener is not None else FileRanges(storage, path)


class FileRanges:
    """Positioned reads through any backend's ``open_read`` file object."""

    align = 1

    def __init__(self, storage: Storage, path: str) -> None:
        self._stack = contextlib.ExitStack()
        self._file = self._stack.enter_context(storage.open_read(path))
        try:
            self.size = self._file.seek(0, io.SEEK_END)
        except BaseException:
            self._stack.close()
            raise

    def readinto(self, offset: int, view: memoryview) -> int:
        self._file.seek(offset)
        got = 0
        while got < len(view):
            readinto = getattr(self._file, "readinto", None)
            if readinto is not None:
                n = readinto(view[got:]) or 0
            else:
                data = self._file.read(len(view) - got)
                n = len(data)
                view[got:got + n] = data
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> FileRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_bytes(ranges: Ranges, path: str, *, expected: dict[str, Any] | None = None) -> bytearray:
    """The whole file, read once and checked against ``expected`` (a rank marker's entry)."""
    check_size(ranges, path, expected)
    out = bytearray(ranges.size)
    source = Source(ranges, path, tail_start=ranges.size)
    try:
        source.take(0, ranges.size, memoryview(out))
        crc = source.finish()
    finally:
        source.close()
    check_crc(path, ranges.size, crc, expected)
    return out


def read_torch(
    ranges: Ranges,
    path: str,
    *,
    expected: dict[str, Any] | None = None,
    target: Any = None,
    weights_only: bool = True,
    map_location: Any = None,
    locations: dict[int, str] | None = None,
) -> Any:
    """Decode the ``torch.save`` archive at ``path`` in one pass over its bytes.

    ``target`` (the object this file restores into) lets storages land in its tensors
    directly; the returned object then views those tensors. With ``locations`` (and no
    ``map_location``) every storage stays on the host and its saved location is noted under
    its ``data_ptr``, for :func:`.restore.copy_into_target` to copy straight to the device.
    """
    check_size(ranges, path, expected)
    tail_start, tail = _read_tail(ranges, path, TAIL)
    records = _central_directory(ranges, path, tail_start, tail)
    if records is None:
        return _load_whole(ranges, path, expected, weights_only, map_location)
    tail_start, tail, records = records
    source = Source(ranges, path, tail_start=tail_start, tail=tail)
    try:
        decoded = _stream_records(source, records, target, weights_only)
        if decoded is None:
            source.close()
            return _load_whole(ranges, path, expected, weights_only, map_location)
        blob, buffers = decoded
        crc = source.finish()
    finally:
        source.close()
    check_crc(path, ranges.size, crc, expected)
    keep = map_location
    if locations is not None and map_location is None:
        def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
            locations[storage.data_ptr()] = location
            return storage
    return unpickle_torch(blob, _storage_lookup(path, buffers), weights_only=weights_only, map_location=keep,
                          copy=False)


def read_range(ranges: Ranges, path: str, offset: int, length: int, out: memoryview) -> None:
    """Read ``[offset, offset + length)`` into ``out`` (any buffer), through an aligned buffer
    where the backend needs one."""
    align = max(ranges.align, 1)
    if align == 1:
        got = ranges.readinto(offset, out[:length])
        if got < length:
            raise CorruptCheckpointError(f"{path}: the file ended at byte {offset + got} while it was read")
        return
    start = offset // align * align
    span = _round_up(offset + length, align) - start
    buffer = mmap.mmap(-1, max(span, PAGE))
    try:
        view = memoryview(buffer)
        got = ranges.readinto(start, view[:span])
        if got < offset + length - start:
            raise CorruptCheckpointError(f"{path}: the file ended at byte {start + got} while it was read")
        out[:length] = view[offset - start:offset - start + length]
        view.release()
    finally:
        buffer.close()


def decode_torch(buffer: Any, length: int, path: str, *, weights_only: bool = True) -> Any:
    """Decode the ``torch.save`` archive in ``buffer[:length]`` (a writable buffer: a ``mmap``, a
    ``bytearray``) with every storage a view of ``buffer`` on the host: nothing is copied, so the
    result is valid only while ``buffer`` holds these bytes."""
    view = memoryview(buffer)[:length]
    entries = _small_directory(view)
    if entries is None:
        try:
            with zipfile.ZipFile(_TailFile(0, view)) as archive:
                entries = [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in archive.infolist()]
        except zipfile.BadZipFile as exc:
            raise CorruptCheckpointError(f"{path}: not a torch.save archive ({exc})") from exc
    blob, storages = None, {}
    for filename, header, size, method in entries:
        if method != zipfile.ZIP_STORED:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(io.BytesIO(bytes(view)), weights_only=weights_only, map_location="cpu")
        start = _data_start(view[header:header + _LOCAL.size], header, filename, path)
        name = filename.split("/", 1)[-1]
        if name == "data.pkl":
            blob = bytes(view[start:start + size])
        elif name.startswith("data/"):
            storages[name[5:]] = (torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=start)
                                  .untyped_storage() if size else torch.UntypedStorage(0))
    view.release()
    if blob is None:
        raise CorruptCheckpointError(f"{path}: the archive has no data.pkl record")
    return unpickle_torch(blob, _storage_lookup(path, storages),
                          weights_only=weights_only, map_location=lambda storage, _loc: storage, copy=False)


def _small_directory(view: memoryview) -> list[tuple[str, int, int, int]] | None:
    """``(name, header offset, size, method)`` of each record of an archive without zip64 fields
    or a comment, parsed straight from its end record; None for any other archive (zipfile reads it)."""
    if len(view) < _END.size:
        return None
    sig, _disk, _cd_disk, _here, count, cd_size, cd_offset, comment = _END.unpack(view[len(view) - _END.size:])
    if sig != _END_SIG or comment or 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
        return None
    if cd_offset + cd_size > len(view) - _END.size:
        return None
    out, pos = [], cd_offset
    for _ in range(count):
        fields = _CENTRAL.unpack(view[pos:pos + _CENTRAL.size])
        if fields[0] != _CENTRAL_SIG or 0xFFFFFFFF in (fields[9], fields[16]):
            return None
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        name = bytes(view[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]).decode()
        out.append((name, fields[16], fields[9], fields[4]))
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return out


def check_size(ranges: Ranges, path: str, expected: dict[str, Any] | None) -> None:
    """Raise :class:`CorruptCheckpointError` when the file is not the size ``expected`` (a rank
    marker's entry) recorded; before a byte is read."""
    if expected is not None and ranges.size != expected["size"]:
        raise CorruptCheckpointError(f"{path}: size {ranges.size} differs from the {expected['size']} recorded when it "
                                     "was written; the file was changed or truncated after the commit")


def check_crc(path: str, size: int, crc: int, expected: dict[str, Any] | None) -> None:
    """Raise :class:`CorruptCheckpointError` when ``crc`` (of the whole file, as :meth:`Source.finish`
    gives it) is not the one ``expected`` recorded."""
    problem = checksum_mismatch(path, size, crc, expected) if expected is not None else None
    if problem is not None:
        raise CorruptCheckpointError(problem)


def _load_whole(ranges: Ranges, path: str, expected: dict[str, Any] | None, weights_only: bool,
                map_location: Any) -> Any:
    data = read_bytes(ranges, path, expected=expected)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _read_tail(ranges: Ranges, path: str, nbytes: int) -> tuple[int, bytes]:
    """``(start, bytes)`` of the file from a page boundary at least ``nbytes`` before its end."""
    size = ranges.size
    start = max(0, size - nbytes) // PAGE * PAGE
    buffer = mmap.mmap(-1, max(PAGE, _round_up(size - start, PAGE)))
    try:
        view = memoryview(buffer)
        got = ranges.readinto(start, view[:_round_up(size - start, max(ranges.align, 1))])
        if got < size - start:
            raise CorruptCheckpointError(f"{path}: the file ended at byte {start + got} of {size} while it was read")
        data = bytes(view[:size - start])
        view.release()
    finally:
        buffer.close()
    return start, data


class _TailFile(io.RawIOBase):
    """The end of a file, seekable as if it were the whole file (what :class:`zipfile.ZipFile` needs
    to read a central directory); a read before ``start`` raises :class:`_NeedMore`."""

    def __init__(self, start: int, data: bytes) -> None:
        self._start, self._data, self._pos = start, data, start

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._start + len(self._data)
        self._pos = offset if whence == io.SEEK_SET else (self._pos + offset if whence == io.SEEK_CUR else end + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos < self._start:
            raise _NeedMore(self._pos)
        chunk = self._data[self._pos - self._start:self._pos - self._start + len(buffer)]
        buffer[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


class _NeedMore(Exception):
    def __init__(self, offset: int) -> None:
        super().__init__(offset)
        self.offset = offset


class _Record:
    __slots__ = ("name", "header", "size")

    def __init__(self, name: str, header: int, size: int) -> None:
        self.name, self.header, self.size = name, header, size


def _central_directory(ranges: Ranges, path: str, tail_start: int, tail: bytes
                       ) -> tuple[int, bytes, list[_Record]] | None:
    """The archive's records in file order (and the tail that holds its central directory);
    None for an archive :func:`read_torch` hands to ``torch.load`` instead."""
    for _ in range(3):
        try:
            with zipfile.ZipFile(_TailFile(tail_start, tail)) as archive:
                infos = archive.infolist()
            break
        except _NeedMore as more:
            tail_start, tail = _read_tail(ranges, path, ranges.size - more.offset)
        except zipfile.BadZipFile as exc:
            raise CorruptCheckpointError(f"{path}: not a torch.save archive ({exc})") from exc
    else:
        return None
    if any(info.compress_type != zipfile.ZIP_STORED for info in infos):
        return None
    records = sorted((_Record(info.filename, info.header_offset, info.file_size) for info in infos),
                     key=lambda r: r.header)
    return tail_start, tail, records


def _stream_records(source: Source, records: list[_Record], target: Any, weights_only: bool
                    ) -> tuple[bytes, dict[str, torch.Tensor]] | None:
    """Stream every record to where it goes: ``(pickle, {storage key: host buffer})``, or None
    for an archive whose pickle does not come before its storages, or of another byte order."""
    prefix = records[0].name.split("/", 1)[0] + "/" if records else ""
    sizes = {r.name[len(prefix) + 5:]: r.size for r in records if r.name.startswith(prefix + "data/")}
    blob: bytes | None = None
    buffers: dict[str, torch.Tensor] = {}
    for record in records:
        name = record.name[len(prefix):]
        if name == "data.pkl":
            blob = bytes(_take_record(source, record))
            buffers = _destinations(blob, sizes, target, weights_only)
        elif name == "byteorder":
            if bytes(_take_record(source, record)).decode() != sys.byteorder:
                return None
        elif name.startswith("data/"):
            if blob is None:
                return None
            _take_record(source, record, buffers[name[5:]])
    if blob is None:
        raise CorruptCheckpointError(f"{source.path}: the archive has no data.pkl record")
    return blob, buffers


def _data_start(header: Any, offset: int, name: str, path: str) -> int:
    """Where the data of the record whose local header (``header``, its fixed part) sits at
    ``offset`` begins: after the header, the record's name and its extra field."""
    fields = _LOCAL.unpack(header)
    if fields[0] != _LOCAL_SIG:
        raise CorruptCheckpointError(f"{path}: no local header for {name} at byte {offset}")
    return offset + _LOCAL.size + fields[9] + fields[10]


def _take_record(source: Source, record: _Record, dest: torch.Tensor | None = None) -> Any:
    header = bytearray(_LOCAL.size)
    source.take(record.header, _LOCAL.size, memoryview(header))
    start = _data_start(header, record.header, record.name, source.path)
    out: Any = memoryview(bytearray(record.size)) if dest is None else dest
    source.take(start, record.size, out)
    return out


def _destinations(blob: bytes, sizes: dict[str, int], target: Any, weights_only: bool) -> dict[str, torch.Tensor]:
    """A flat ``uint8`` host buffer for every storage: the target's own tensor where one tensor
    of the target receives the whole storage, else fresh memory."""
    claims: dict[str, list[torch.Tensor]] = {}
    refs: dict[str, int] = {}
    if target is not None:
        keys: dict[int, str] = {}

        def meta_storage(key: str) -> torch.UntypedStorage:
            storage = torch.UntypedStorage(sizes.get(key, 0), device="meta")
            keys[storage._cdata] = key  # noqa: SLF001 - the storage's identity, as the tensors see it
            return storage

        try:  # shapes only (no data): an object that cannot be rebuilt so gets fresh buffers, read as before
            shaped = unpickle_torch(blob, meta_storage, weights_only=weights_only, map_location=lambda s, _loc: s,
                                    copy=False, refs=refs)
        except Exception:
            shaped, refs = None, {}
        _claim(shaped, target, keys, sizes, claims)
    out: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for key, nbytes in sizes.items():
        mine = claims.get(key, [])
        if len(mine) == 1 and refs.get(key) == 1 and mine[0].untyped_storage().data_ptr() not in taken:
            storage = mine[0].untyped_storage()
            taken.add(storage.data_ptr())
            out[key] = torch.empty(0, dtype=torch.uint8).set_(storage)
        else:
            out[key] = torch.empty(nbytes, dtype=torch.uint8)
    return out


def _claim(loaded: Any, target: Any, keys: dict[int, str], sizes: dict[str, int],
           claims: dict[str, list[torch.Tensor]]) -> None:
    """Note, per storage key, the target tensors that would receive the whole storage as is
    (matching by structure, as :func:`.restore.copy_into_target` does)."""
    if isinstance(loaded, torch.Tensor):
        key = keys.get(loaded.untyped_storage()._cdata)  # noqa: SLF001
        if key is not None and _receives_whole(loaded, target, sizes[key]):
            claims.setdefault(key, []).append(target)
        return
    if isinstance(loaded, Mapping):
        for name, value in loaded.items():
            _claim(value, target.get(name) if isinstance(target, Mapping) else None, keys, sizes, claims)
    elif isinstance(loaded, (list, tuple)) and not hasattr(loaded, "_fields"):
        if isinstance(target, (list, tuple)) and len(target) == len(loaded):
            for value, into in zip(loaded, target):
                _claim(value, into, keys, sizes, claims)


def _receives_whole(loaded: torch.Tensor, target: Any, nbytes: int) -> bool:
    return (type(target) in (torch.Tensor, torch.nn.Parameter) and target.device.type == "cpu"
            and target.dtype == loaded.dtype and target.shape == loaded.shape
            and target.is_contiguous() and loaded.is_contiguous()
            and target.storage_offset() == 0 and loaded.storage_offset() == 0
            and target.untyped_storage().nbytes() == nbytes == loaded.numel() * loaded.element_size())


def _storage_lookup(path: str, buffers: Mapping[str, torch.Tensor | torch.UntypedStorage]) -> Any:
    def storage_for_key(key: str) -> torch.UntypedStorage:
        if key not in buffers:
            raise CorruptCheckpointError(f"{path}: the pickle names storage {key}, which the archive lacks")
        found = buffers[key]
        return found.untyped_storage() if isinstance(found, torch.Tensor) else found
    return storage_for_key


class Source:
    """The bytes of a file in order: ``[0, tail_start)`` streamed by :class:`_Stream`, the rest
    from ``tail`` (already read); :meth:`finish` gives the crc32 of the whole file."""

    def __init__(self, ranges: Ranges, path: str, *, tail_start: int, tail: bytes = b"") -> None:
        self.path = path
        self._tail_start, self._tail = tail_start, tail
        self._stream = _Stream(ranges, path, tail_start)

    def take(self, offset: int, length: int, dest: Any) -> None:
        """Copy bytes ``[offset, offset + length)`` into ``dest`` (a ``uint8`` tensor or a
        writable memoryview); offsets only move forward below the tail."""
        cut = max(0, min(length, self._tail_start - offset))
        if cut:
            self._stream.take(offset, cut, dest)
        if cut < length:
            start = offset + cut - self._tail_start
            piece = self._tail[start:start + length - cut]
            if len(piece) < length - cut:
                raise CorruptCheckpointError(f"{self.path}: a record runs past the end of the file")
            if isinstance(dest, torch.Tensor):
                dest[cut:length].copy_(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
            else:
                dest[cut:length] = piece

    def finish(self) -> int:
        crc, tail = self._stream.finish(), crc32(self._tail)
        return crc32_combine(crc, tail, len(self._tail)) if self._tail_start else tail

    def close(self) -> None:
        self._stream.close()


class _Stream:
    """``[0, end)`` of a file in order: a thread reads ahead into page-aligned buffers, and each
    buffer is checksummed once, on the caller's thread, when the caller first takes from it."""

    def __init__(self, ranges: Ranges, path: str, end: int) -> None:
        self.path, self.end, self.crc = path, end, 0
        self._chunk = min(getattr(ranges, "chunk", CHUNK), _round_up(max(end, 1), PAGE))
        depth = DEPTH if end > self._chunk else 1
        self._buffers = [mmap.mmap(-1, self._chunk) for _ in range(depth)]
        self._tensors = [torch.frombuffer(buffer, dtype=torch.uint8) for buffer in self._buffers]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._full: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for index in range(depth):
            self._free.put(index)
        self._stop = threading.Event()
        self._current: tuple[int, int, int] | None = None  # (buffer, file offset, bytes)
        self._thread = threading.Thread(target=self._read_ahead, args=(ranges,), name="flashckpt-read", daemon=True)
        if end > 0:
            self._thread.start()

    def _read_ahead(self, ranges: Ranges) -> None:
        try:
            for offset in range(0, self.end, self._chunk):
                index = self._free.get()
                if self._stop.is_set():
                    return
                length = min(self._chunk, self.end - offset)
                view = memoryview(self._buffers[index])[:_round_up(length, max(ranges.align, 1))]
                got = ranges.readinto(offset, view)
                view.release()
                if got < length:
                    raise CorruptCheckpointError(f"{self.path}: the file ended at byte {offset + got} while it was "
                                                 "read")
                self._full.put((index, offset, length))
        except BaseException as exc:  # raised on the caller's thread
            self._full.put(exc)

    def _advance(self) -> None:
        if self._current is not None:
            self._free.put(self._current[0])
            self._current = None
        item = self._full.get()
        if isinstance(item, BaseException):
            raise item
        index, _offset, length = item
        view = memoryview(self._buffers[index])[:length]
        self.crc = crc32(view, self.crc)
        view.release()
        self._current = item

    def take(self, offset: int, length: int, dest: Any) -> None:
        done = 0
        while done < length:
            pos = offset + done
            while self._current is None or pos >= self._current[1] + self._current[2]:
                self._advance()
            index, start, size = self._current
            if pos < start:
                raise CorruptCheckpointError(f"{self.path}: records overlap at byte {pos}")
            a = pos - start
            b = min(size, a + length - done)
            if isinstance(dest, torch.Tensor):
                dest[done:done + b - a].copy_(self._tensors[index][a:b])
            else:
                dest[done:done + b - a] = memoryview(self._buffers[index])[a:b]
            done += b - a

    def finish(self) -> int:
        """Read through the end; the crc32 of ``[0, end)``."""
        while self.end and (self._current is None or self._current[1] + self._current[2] < self.end):
            self._advance()
        return self.crc

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            for _ in self._buffers:
                self._free.put(-1)
            self._thread.join()
