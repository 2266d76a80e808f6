"""The zip layout of ``torch.save``, written without torch.

``torch.save(obj, f)`` writes a zip archive through PyTorch's ``PyTorchStreamWriter`` (miniz,
plus an extra field that pads each record so that its data starts at a multiple of 64 bytes).
This module writes the same bytes from plain buffers with :mod:`struct` and :mod:`zlib` only,
so that a process that just writes such files never has to import torch. Call order::

    writer = TorchZipWriter(fileobj)                  # records are named "archive/<name>"
    writer.write_record("data.pkl", pickle_bytes)
    writer.write_record(".format_version", "1")
    writer.write_record(".storage_alignment", "64")
    writer.write_record("byteorder", sys.byteorder)
    writer.write_record("data/0", storage_bytes)      # one per storage, in torch.save's key order
    ...
    writer.finish()      # adds "version" and ".data/serialization_id", then the central directory

``fileobj`` needs only ``write``; nothing is seeked back to, so it may be a pipe or an upload
stream: as torch writes it, each record's CRC-32 and sizes follow its data in a data descriptor,
and the local header holds zeros for them. :func:`archive_size` is the size of such a file,
computed without writing it.

What torch 2.x writes, and so this module (checked byte for byte against
``torch._C.PyTorchFileWriter(f, True, 64)`` in the tests):

* Each record: a local header (version needed 0, flags 0x0808 = UTF-8 name + data descriptor,
  or 0x0800 for an empty record, which has no descriptor; stored; DOS time and date 0; CRC and
  sizes 0); the name ``archive/<name>`` (torch names the folder after the file when it is given
  a path, ``archive`` when given a file object); a zip64 extended-information field only when
  the record's size or its header's offset is at least 0xFFFFFFFF (sizes if the size is, then
  the offset if the offset is; miniz leaves the compressed size 0 there); an ``FB`` field of
  ``Z`` bytes that pads the data to the alignment; the data, stored; the data descriptor
  (signature, CRC-32 and sizes, 64-bit when the record has the zip64 field).
* The central directory: one entry per record (version made by and needed 0, same flags, CRC,
  sizes and offset capped at 0xFFFFFFFF, the same zip64 field, no padding field), then always a
  zip64 end-of-central-directory record and locator, then the end-of-central-directory record.
* ``finish`` writes ``version`` (``3\\n``), ``byteorder`` if it was not written, and
  ``.data/serialization_id``: 20 digits of a combined hash of the record names (libstdc++'s
  ``std::hash`` in ``std::unordered_set`` order) and 20 of a combined hash of the records' CRCs.
  Both are deterministic, so the whole file is.
"""

from __future__ import annotations

import functools
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from typing import IO, Any

from .._utils.crc32 import crc32

__all__ = ["STORAGE_ALIGNMENT", "TorchZipWriter", "archive_size", "crc32_combine"]

STORAGE_ALIGNMENT = 64
SERIALIZATION_ID = ".data/serialization_id"
_VERSION = b"3\n"  # PyTorch's kMinProducedFileFormatVersion, what torch.save archives carry

_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_END = struct.Struct("<IHHHHIIH")  # 22 bytes
_LOCAL_SIG, _CENTRAL_SIG, _DESCRIPTOR_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_ZIP64_END_SIG, _ZIP64_LOCATOR_SIG, _END_SIG = 0x06064B50, 0x07064B50, 0x06054B50
_DESCRIPTOR_MAGIC = struct.pack("<I", _DESCRIPTOR_SIG)
_FLAG_UTF8, _FLAG_DESCRIPTOR = 0x0800, 0x0008


class _Layout:
    """Offsets, headers and the central directory of an archive; data are not its concern."""

    def __init__(self, archive_name: str, alignment: int) -> None:
        if not archive_name or archive_name.startswith("/"):
            raise ValueError(f"invalid archive name {archive_name!r}")
        if alignment < 1:
            raise ValueError(f"alignment must be positive, not {alignment}")
        self.prefix = archive_name.encode() + b"/"
        self.alignment = alignment
        self.offset = 0
        self.names: dict[str, None] = {}  # in write order
        self.central: list[bytes] = []
        self.central_size = 0
        self._open: tuple[str, bytes, int, int, bytes] | None = None

    def begin(self, name: str, nbytes: int) -> bytes:
        """The local header (with name and extra fields) of the record ``name`` of ``nbytes``."""
        if name in self.names or self._open is not None:
            raise ValueError(f"record {name!r} was already written" if name in self.names else
                             "the previous record is not finished")
        full = self.prefix + name.encode()
        offset = self.offset
        zip64 = _zip64_field(nbytes, offset)
        start = offset + _LOCAL.size + len(full) + len(zip64) + 4
        padding = -start % self.alignment
        extra = _zip64_field(nbytes, offset, local=True) + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        if len(full) > _U16 or len(extra) > _U16:
            raise ValueError(f"record {name!r}: name or padding too long for a zip header")
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if nbytes else 0)
        header = _LOCAL.pack(_LOCAL_SIG, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra
        self._open = (name, full, nbytes, offset, zip64)
        self.offset += len(header) + nbytes
        return header

    def end(self, crc: int) -> bytes:
        """Finish the open record: its data descriptor (empty for an empty record)."""
        assert self._open is not None
        name, full, nbytes, offset, zip64 = self._open
        self._open = None
        descriptor = b""
        if nbytes:
            layout = _DESCRIPTOR64 if zip64 else _DESCRIPTOR32
            descriptor = layout.pack(_DESCRIPTOR_SIG, crc, nbytes, nbytes)
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if nbytes else 0)
        entry = _CENTRAL.pack(_CENTRAL_SIG, 0, 0, flags, 0, 0, 0, crc, min(nbytes, _U32), min(nbytes, _U32),
                              len(full), len(zip64), 0, 0, 0, 0, min(offset, _U32)) + full + zip64
        if self.central_size + len(entry) >= _U32:
            raise ValueError("central directory of 4 GiB or more: too many records")
        self.central.append(entry)
        self.central_size += len(entry)
        self.names[name] = None
        self.offset += len(descriptor)
        return descriptor

    def tail(self) -> bytes:
        """Central directory, zip64 end record and locator, end record."""
        count, cd_offset, cd_size = len(self.central), self.offset, self.central_size
        zip64_end = cd_offset + cd_size
        return b"".join([
            *self.central,
            _ZIP64_END.pack(_ZIP64_END_SIG, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, count, count, cd_size,
                            cd_offset),
            _ZIP64_LOCATOR.pack(_ZIP64_LOCATOR_SIG, 0, zip64_end, 1),
            _END.pack(_END_SIG, 0, 0, min(count, _U16), min(count, _U16), min(cd_size, _U32), min(cd_offset, _U32), 0),
        ])

    def tail_size(self) -> int:
        return self.central_size + _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size


def _zip64_field(nbytes: int, offset: int, *, local: bool = False) -> bytes:
    """miniz's zip64 extended-information field for a record (empty when it needs none).

    In the local header the compressed size is 0: miniz makes that field before the data.
    """
    values = (nbytes, 0 if local else nbytes) if nbytes >= _U32 else ()
    values += (offset,) if offset >= _U32 else ()
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""


def _final_records(names: dict[str, None]) -> list[tuple[str, bytes]]:
    """What ``PyTorchStreamWriter::writeEndOfFile`` adds before the serialization id."""
    out = []
    if "version" not in names and ".data/version" not in names:
        out.append(("version", _VERSION))
    if "byteorder" not in names:
        out.append(("byteorder", sys.byteorder.encode()))
    return out


class TorchZipWriter:
    """Write a ``torch.save`` archive to ``fileobj``, record by record (see the module docstring).

    ``write_crc32(view)``, when given, writes a large record's data to ``fileobj`` and returns its
    CRC-32 (a caller can compute it beside the write); without it the data are checksummed with
    ``crc32`` and then written. Records under ``buffer_below`` bytes are gathered with the
    headers and written in larger pieces. Errors from ``fileobj`` propagate; an archive left
    unfinished is just a truncated file.
    """

    def __init__(
        self, fileobj: IO[bytes], archive_name: str = "archive", *, alignment: int = STORAGE_ALIGNMENT,
        write_crc32: Callable[[memoryview], int] | None = None, buffer_below: int = 1 << 18,
    ) -> None:
        self._f = fileobj
        self._layout = _Layout(archive_name, alignment)
        self._write_crc32 = write_crc32
        self._buffer_below = buffer_below
        self._pending: list[Any] = []
        self._pending_size = 0
        self._crc_hash = 0  # torch's combined_uncomp_crc32_
        self.serialization_id: str | None = None
        self.finished = False

    @property
    def size(self) -> int:
        """Bytes of the archive so far (all of it once finished)."""
        return self._layout.offset + (self._layout.tail_size() if self.finished else 0)

    def write_record(self, name: str, data: Any) -> None:
        """Write the record ``name`` (``data``: bytes-like, or str written as UTF-8)."""
        if self.finished:
            raise ValueError("the archive is finished")
        if name == SERIALIZATION_ID:
            raise ValueError(f"{SERIALIZATION_ID} is written by finish()")
        view = memoryview(data.encode() if isinstance(data, str) else data).cast("B")
        nbytes = view.nbytes
        self._add(self._layout.begin(name, nbytes))
        if nbytes >= self._buffer_below:
            self.flush()
            if self._write_crc32 is not None:
                crc = self._write_crc32(view)
            else:
                crc = crc32(view)
                self._f.write(view)
        else:
            crc = crc32(view)
            if nbytes:
                self._add(view)
        if nbytes:
            # torch folds in the CRC of every data descriptor it writes, and (a quirk of how it
            # spots them) four bytes of any data that happen to start like one
            if nbytes >= 8 and view[:4] == _DESCRIPTOR_MAGIC:
                self._crc_hash = _hash_combine(self._crc_hash, int.from_bytes(view[4:8], "little"))
            self._crc_hash = _hash_combine(self._crc_hash, crc)
        self._add(self._layout.end(crc))

    def finish(self) -> None:
        """Write the records torch adds at the end, the central directory and the end records."""
        if self.finished:
            return
        for name, data in _final_records(self._layout.names):
            self.write_record(name, data)
        self.serialization_id = f"{_names_hash(list(self._layout.names)):020d}{self._crc_hash:020d}"
        self._add(self._layout.begin(SERIALIZATION_ID, len(self.serialization_id)))
        sid = self.serialization_id.encode()
        self._add(sid)
        self._add(self._layout.end(zlib.crc32(sid)))
        self._add(self._layout.tail())
        self.flush()
        self.finished = True

    def flush(self) -> None:
        """Write what is gathered (``fileobj`` itself is not flushed)."""
        if self._pending:
            chunk = b"".join(self._pending)
            self._pending.clear()
            self._pending_size = 0
            self._f.write(chunk)

    def _add(self, piece: Any) -> None:
        if piece:
            self._pending.append(piece)
            self._pending_size += len(piece)
            if self._pending_size >= 1 << 20:
                self.flush()


def archive_size(
    records: Iterable[tuple[str, int]], archive_name: str = "archive", *, alignment: int = STORAGE_ALIGNMENT,
) -> int:
    """Size of the archive :class:`TorchZipWriter` writes for ``records`` (name, size) in that order.

    It counts the records :meth:`TorchZipWriter.finish` adds; data are never needed.
    """
    layout = _Layout(archive_name, alignment)
    for name, nbytes in records:
        if name == SERIALIZATION_ID:
            raise ValueError(f"{SERIALIZATION_ID} is written by finish()")
        layout.begin(name, nbytes)
        layout.end(0)
    for name, data in [*_final_records(layout.names), (SERIALIZATION_ID, b"0" * 40)]:
        layout.begin(name, len(data))
        layout.end(0)
    return layout.offset + layout.tail_size()


# CRC-32 of a concatenation from the CRC-32s of its parts (zlib's crc32_combine, which Python's
# zlib lacks): the first CRC is multiplied by x^(8 * len2) modulo the CRC polynomial.

_POLY = 0xEDB88320  # reflected: bit 31 is x^0


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order)."""
    product = 0
    m = 1 << 31
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial; x^1 is bit 30
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=1024)
def _x8nmodp(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len(b)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


# The serialization id's name hash: torch combines std::hash<std::string> of each record name
# over a std::unordered_set<std::string> of them, so the libstdc++ hash and iteration order.

_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)


def _std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> (_Hash_bytes, 64-bit, little-endian)."""
    n = len(data)
    h = _SEED ^ (n * _MUL & _M64)
    whole = n & ~7
    for (word,) in struct.iter_unpack("<Q", data[:whole]):
        word = word * _MUL & _M64
        h ^= (word ^ (word >> 47)) * _MUL & _M64
        h = h * _MUL & _M64
    if n & 7:
        h = (h ^ int.from_bytes(data[whole:], "little")) * _MUL & _M64
    h = (h ^ (h >> 47)) * _MUL & _M64
    return h ^ (h >> 47)


# Bucket counts a libstdc++ unordered_set steps through as it grows (prime rehash policy, load
# factor 1): inserting element k rehashes to the next count once k exceeds the current one.
_STD_BUCKETS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
                712697, 1447153, 2938679, 5967347, 12117689, 24607243)


def _std_set_order(hashes: list[int]) -> list[int]:
    """Indices of ``hashes``, inserted in turn into a libstdc++ unordered_set, in its iteration order.

    The set is a singly linked list of nodes; ``buckets[b]`` is the node before bucket b's first.
    A node goes to the front of its bucket, or to the front of the list if its bucket is empty.
    """
    head = -1
    nxt: dict[int, int | None] = {head: None}
    buckets: list[int | None] = []
    count = 0
    growth = iter(_STD_BUCKETS)
    for index, h in enumerate(hashes):
        if index + 1 > count:
            new = next(growth, None)
            if new is not None:
                count, buckets = new, _rehash(nxt, hashes, new)
        b = h % count
        before = buckets[b]
        if before is not None:
            nxt[index], nxt[before] = nxt[before], index
        else:
            nxt[index], nxt[head] = nxt[head], index
            if nxt[index] is not None:
                buckets[hashes[nxt[index]] % count] = index
            buckets[b] = head
    order, node = [], nxt[head]
    while node is not None:
        order.append(node)
        node = nxt[node]
    return order


def _rehash(nxt: dict[int, int | None], hashes: list[int], count: int) -> list[int | None]:
    head = -1
    buckets: list[int | None] = [None] * count
    node, nxt[head], first_bucket = nxt[head], None, 0
    while node is not None:
        following, b = nxt[node], hashes[node] % count
        before = buckets[b]
        if before is None:
            nxt[node], nxt[head] = nxt[head], node
            buckets[b] = head
            if nxt[node] is not None:
                buckets[first_bucket] = node
            first_bucket = b
        else:
            nxt[node], nxt[before] = nxt[before], node
        node = following
    return buckets


def _names_hash(names: list[str]) -> int:
    hashes = [_std_hash(name.encode()) for name in names]
    combined = 0
    for index in _std_set_order(hashes):
        combined = _hash_combine(combined, hashes[index])
    return combined
