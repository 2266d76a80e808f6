"""Shared-memory slots: one rank's snapshot lives in one slot, two slots per rank.

A slot is a file in ``/dev/shm`` (mode 0600, owned by the user) mapped into the trainer and
the saver. Its first 4 KiB are a header; tensor regions and blobs follow; the JSON metadata
that describes them sits after the data::

    offset  size  field
    0       8     magic  b"FLSHCKPT"
    8       4     format version
    12      4     state: 0 empty, 1 writing, 2 complete
    16      8     step (signed)
    24      8     seq: a per-rank save counter
    32      8     metadata offset
    40      8     metadata length
    48      4     crc32 of the metadata
    56      8     persist_req: the seq the trainer asked the saver to persist
    64      8     persist_done: the seq the saver finished persisting (ok or failed)
    72      8     copied: how many regions of the snapshot being written are in place
    80      8     wanted: raised by a trainer that waits for this slot (a copy that only borrows
                  the slot's lock lets go of it)

A persist may start while the slot is still being written (the saver streams each region to
storage once ``copied`` says it is in place); it is finished only once the slot is complete.

The trainer writes ``state=writing`` before it touches the data and ``state=complete`` last,
after the metadata and its checksum, so a crash mid-copy leaves a slot that is never loaded.
The saver only writes ``persist_done``. ``persist_req``/``persist_done`` record what was asked and
done (for inspection); what keeps a save out of a slot being persisted is the saver's ``flock``
on the slot file, plus the trainer's own record of requests not yet answered.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from .._utils.locks import same_file
from ..errors import CorruptCheckpointError, SharedMemoryError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAGIC = b"FLSHCKPT"
VERSION = 1
HEADER_SIZE = 4096
_HEAD = struct.Struct("<8sIIqqqqI")  # magic .. meta crc, 52 bytes
_OFF_STATE = 12
_OFF_PERSIST_REQ = 56
_OFF_PERSIST_DONE = 64
_OFF_COPIED = 72
_OFF_WANTED = 80
_U64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
GROWTH = 1.04
"""A slot grows to this factor of what a save needs, so small growth does not remap each save."""


class SlotState(IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2


@dataclass(frozen=True)
class SlotHeader:
    state: SlotState
    step: int
    seq: int
    meta_offset: int
    meta_len: int
    meta_crc: int
    persist_req: int
    persist_done: int


def shm_free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class Slot:
    """One mapped shared-memory segment. Not thread-safe: one writer at a time."""

    def __init__(self, path: str, fd: int, size: int, populate: bool) -> None:
        self.path = path
        self._fd = fd
        self.size = size
        self._mm: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._pinned = False
        self._pin_lock = threading.Lock()
        self._pin_start: int | None = None
        """The start address of the current mapping's registration (the whole mapping), if any."""
        self._pin_device: int | None = None
        self.pin_pending = False
        """Set by the engine while a registration of this slot is queued off the training path."""
        self._map(populate)

    # --- creation and attachment -----------------------------------------------------------

    @classmethod
    def create_or_open(cls, path: str, min_size: int, *, populate: bool = True) -> Slot:
        """Open the slot at ``path``, creating it (0600, pre-faulted unless not ``populate``) or
        growing it as needed. Its bytes are allocated either way (``fallocate``).

        When the slot cannot be sized or mapped (too little shared memory, a file size limit, no
        address space), a file this call created is removed again: a failed creation leaves no
        empty or partial slot behind.
        """
        fd, created = _open_or_create(path)
        try:
            _check_owner(path, fd)
            size = os.fstat(fd).st_size
            if size < min_size:
                size = _grow(path, fd, size, min_size)
            try:
                return cls(path, fd, size, populate=populate)
            except OSError as exc:  # mmap: ENOMEM (address space, locked-memory limits)
                raise SharedMemoryError(f"cannot map shared-memory slot {path} of {size} bytes: {exc}") from exc
        except BaseException:
            if created:
                _unlink_if_same(path, fd)
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, *, populate: bool = False) -> Slot | None:
        """Map an existing slot, or return ``None`` when there is none."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SharedMemoryError(f"cannot open shared-memory slot {path}: {exc}") from exc
        try:
            _check_owner(path, fd)
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        if size < HEADER_SIZE:
            os.close(fd)
            return None
        return cls(path, fd, size, populate=populate)

    def _map(self, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mm = mmap.mmap(self._fd, self.size, flags=flags)
        self._tensor = None  # made on first use: the saver reads slots without torch
        self.copy_targets: dict[tuple[Any, ...], Any] = {}
        """Views of this mapping the last copy into it wrote through (see ``state.copy_regions``)."""

    def fault_in_from_end(self, front: Callable[[], int]) -> None:
        """Map the pages in from the slot's end down to ``front()``, the offset a copy writing
        from the start has reached (it is read again before every chunk).

        For a slot mapped without populating, on a helper thread while the first copy into it
        runs: each page is faulted in once, by whichever of the two gets there first, so the copy
        pays for about half of the faults instead of all of them (or of a ``MAP_POPULATE`` before
        it). Needs ``MADV_POPULATE_WRITE`` (Linux 5.14); without it this returns at once and the
        copy faults every page itself.
        """
        if self._mm is None or _madvise() is None:
            return
        address = self.buffer.data_ptr()
        end = self.size
        while end > 0:
            start = max(end - _FAULT_CHUNK, front() // mmap.PAGESIZE * mmap.PAGESIZE)
            if start >= end:
                return
            if _madvise()(address + start, end - start, _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL (an older kernel), ENOMEM: the copy faults the rest itself
            end = start

    def ensure_size(self, min_size: int) -> None:
        """Grow the slot to hold ``min_size`` bytes; existing bytes are kept."""
        if min_size <= self.size:
            return
        self._unmap()
        try:
            self.size = _grow(self.path, self._fd, self.size, min_size)
        finally:  # grown, or not (too little shared memory): the slot stays usable at its size
            self._map(populate=True)
        # (the new mapping is registered again by the engine, off the training path: see pin())

    def _unmap(self) -> None:
        with self._pin_lock:  # a registration on another thread sees the mapping whole, or gone
            self._unpin_locked()
            self._tensor = None
            self.copy_targets = {}
            if self._mm is not None:
                # Tensors that still view the mapping keep it alive; it is unmapped when they go.
                with contextlib.suppress(BufferError):
                    self._mm.close()
                self._mm = None

    def close(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # A slot dropped while CUDA has it registered: unregister before the mapping goes, or the
        # driver keeps the range and a later allocation that reuses the addresses fails
        # ("resource already mapped"). Slots are closed explicitly; this is the safety net.
        if getattr(self, "_pin_start", None) is not None:
            with contextlib.suppress(Exception):
                self._unmap()

    def replaced(self) -> bool:
        """Whether the slot's name no longer leads to the mapped file (removed or recreated)."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return True

    def file_size(self) -> int:
        return os.fstat(self._fd).st_size

    def lock(self) -> None:
        """Hold an exclusive lock on the slot file (the saver, while it persists the slot)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def try_lock(self) -> bool:
        """Take the exclusive lock if no one holds it; whether it was taken."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        if self._fd >= 0:  # closing the file released the lock already
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # --- page-locking for device-to-host copies --------------------------------------------

    @property
    def pinned(self) -> bool:
        """The whole mapping is page-locked for device copies."""
        return self._pinned

    @property
    def needs_pin(self) -> bool:
        """The mapping is not page-locked yet, and registering can still succeed."""
        from .._utils.devices import pin_failure

        return not self._pinned and pin_failure() is None and _torch().cuda.is_available()

    def pin(self, device_index: int | None = None) -> bool:
        """Page-lock the mapping for CUDA device ``device_index``, so device copies into it run
        asynchronously at full bandwidth.

        Registers the whole mapping in one ``cudaHostRegister`` call with ``cudaHostRegisterPortable``
        (as torch does), under ``torch.cuda.device(index)`` (the calling thread's current device would
        otherwise get a CUDA context). One call, not several ranges: CUDA refuses a copy whose host
        range spans two registrations ("invalid argument"), and a tensor's bytes may lie anywhere in
        the slot. A failed registration clears CUDA's last error and is remembered for the process:
        later calls return ``False`` at once, and it is logged once. Call it off the training path
        (the engine does); copies into a slot not (yet) page-locked are correct, only slower.
        """
        from .._utils import devices

        if not _torch().cuda.is_available():
            return False
        with self._pin_lock:
            if self._mm is None:
                return False
            if self._pinned:
                return True
            if devices.pin_failure() is not None:
                return False
            start = self.buffer.data_ptr()
            error = devices.host_register(start, self.size, device_index)
            if error is not None:
                logger.warning("page-locking shared-memory slot %s failed: %s; device copies into it (and "
                               "restores from it) run at pageable-memory speed. Not retried in this process.",
                               self.path, error)
                return False
            self._pin_start = start
            self._pin_device = device_index
            self._pinned = True
            return True

    def _unpin_locked(self) -> None:
        """Unregister the mapping (with ``_pin_lock`` held): never unmap it while CUDA has it registered."""
        if self._pin_start is not None:
            from .._utils.devices import host_unregister

            host_unregister(self._pin_start, self._pin_device)
        self._pin_start = None
        self._pinned = False

    # --- header ----------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """A uint8 tensor over the whole slot (no copy)."""
        if self._tensor is None and self._mm is not None:
            self._tensor = _torch().frombuffer(self._mm, dtype=_torch().uint8)
        return self._tensor

    def read_header(self) -> SlotHeader | None:
        """Return the header, or ``None`` for a slot that never held a snapshot."""
        magic, version, state, step, seq, meta_off, meta_len, crc = _HEAD.unpack_from(self._mm, 0)
        if magic != MAGIC:
            return None
        if version != VERSION:
            raise CorruptCheckpointError(
                f"slot {self.path} has format version {version}, this package reads {VERSION}; "
                "remove stale slots with `flashckpt clean` or restart with a new job id"
            )
        try:
            state = SlotState(state)
        except ValueError as exc:
            raise CorruptCheckpointError(f"slot {self.path} has an invalid state {state}") from exc
        req = _U64.unpack_from(self._mm, _OFF_PERSIST_REQ)[0]
        done = _U64.unpack_from(self._mm, _OFF_PERSIST_DONE)[0]
        return SlotHeader(state, step, seq, meta_off, meta_len, crc, req, done)

    def begin_write(self, step: int, seq: int) -> None:
        """Mark the slot as being written; from here on it is not loadable."""
        _U32.pack_into(self._mm, _OFF_STATE, SlotState.WRITING)
        header = self.read_header()
        req = header.persist_req if header else 0
        done = header.persist_done if header else 0
        _HEAD.pack_into(self._mm, 0, MAGIC, VERSION, SlotState.WRITING, step, seq, 0, 0, 0)
        _U64.pack_into(self._mm, _OFF_PERSIST_REQ, max(req, done))
        _U64.pack_into(self._mm, _OFF_PERSIST_DONE, max(req, done))

    def write_blob(self, offset: int, data: bytes) -> None:
        self._mm[offset : offset + len(data)] = data

    def write_metadata(self, step: int, seq: int, meta_offset: int, raw: bytes) -> None:
        """Write the (JSON) metadata and its checksum; the slot stays in the writing state."""
        if meta_offset + len(raw) > self.size:
            raise SharedMemoryError(f"slot {self.path} is too small for its metadata; this is a bug")
        self._mm[meta_offset : meta_offset + len(raw)] = raw
        crc = zlib.crc32(raw)
        _U64.pack_into(self._mm, _OFF_COPIED, 0)
        _HEAD.pack_into(self._mm, 0, MAGIC, VERSION, SlotState.WRITING, step, seq, meta_offset, len(raw), crc)

    def publish_copied(self, regions: int) -> None:
        """Say that the first ``regions`` regions are in place (a streaming persist reads them)."""
        _U64.pack_into(self._mm, _OFF_COPIED, regions)

    def copied(self) -> int:
        return _U64.unpack_from(self._mm, _OFF_COPIED)[0]

    def seal(self) -> None:
        """Mark the slot complete: from here on it is loadable."""
        _U32.pack_into(self._mm, _OFF_STATE, SlotState.COMPLETE)

    def want(self) -> None:
        """Say that a save waits for this slot: a replication copy holding its lock gives it up."""
        _U64.pack_into(self._mm, _OFF_WANTED, self.wanted() + 1)

    def wanted(self) -> int:
        """How often a save asked for this slot (compare two readings: a change means one waits)."""
        return _U64.unpack_from(self._mm, _OFF_WANTED)[0]

    def mark_persist_requested(self, seq: int) -> None:
        _U64.pack_into(self._mm, _OFF_PERSIST_REQ, seq)

    def mark_persist_done(self, seq: int) -> None:
        _U64.pack_into(self._mm, _OFF_PERSIST_DONE, seq)

    def invalidate(self) -> None:
        """Mark the slot empty (never loaded). A slot already closed (a job's end unmapped it under
        a copy still running) is left as it is: its file says writing, or it is gone."""
        if self._mm is None:
            return
        _U32.pack_into(self._mm, _OFF_STATE, SlotState.EMPTY)

    def read_metadata(self, header: SlotHeader) -> dict[str, Any]:
        """Return the metadata of a complete slot, checking its bounds and checksum."""
        end = header.meta_offset + header.meta_len
        if header.meta_offset < HEADER_SIZE or end > self.size or header.meta_len <= 0:
            raise CorruptCheckpointError(
                f"slot {self.path}: metadata range [{header.meta_offset}, {end}) is outside the "
                f"slot of {self.size} bytes"
            )
        raw = bytes(self._mm[header.meta_offset : end])
        if zlib.crc32(raw) != header.meta_crc:
            raise CorruptCheckpointError(
                f"slot {self.path}: metadata checksum mismatch for step {header.step}; the slot is "
                "corrupt and will not be loaded"
            )
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(f"slot {self.path}: metadata is not valid JSON: {exc}") from exc

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise CorruptCheckpointError(
                f"slot {self.path}: range [{offset}, {offset + nbytes}) is outside the slot of {self.size} bytes"
            )

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        self._check_range(offset, nbytes)
        return self.buffer[offset : offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        """A view of the slot's bytes (no copy, no numpy, no torch)."""
        self._check_range(offset, nbytes)
        return memoryview(self._mm)[offset : offset + nbytes]

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        if offset < 0 or offset + nbytes > self.size:
            raise CorruptCheckpointError(f"slot {self.path}: blob range is outside the slot")
        return bytes(self._mm[offset : offset + nbytes])

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """An untyped storage that starts at ``offset`` (no copy)."""
        self._check_range(offset, nbytes)
        return _torch().frombuffer(self._mm, dtype=_torch().uint8, count=nbytes, offset=offset).untyped_storage()


def attach_complete(path: str) -> tuple[Slot, SlotHeader] | None:
    """Map the slot at ``path`` when it holds a complete snapshot: the slot (the caller closes it)
    and its header; ``None`` (nothing left mapped) when there is no slot or no complete snapshot."""
    slot = Slot.attach(path)
    if slot is None:
        return None
    try:
        header = slot.read_header()
    except BaseException:
        slot.close()
        raise
    if header is None or header.state is not SlotState.COMPLETE:
        slot.close()
        return None
    return slot, header



@contextlib.contextmanager
def complete_snapshot(path: str) -> Iterator[tuple[Slot, SlotHeader, dict[str, Any]] | None]:
    """The complete snapshot in slot ``path`` for the length of a ``with`` block: ``(slot, header,
    metadata)``, unmapped at its end; ``None`` when there is no slot or no complete snapshot.
    Unreadable metadata raises :class:`CorruptCheckpointError` (nothing is left mapped)."""
    found = attach_complete(path)
    if found is None:
        yield None
        return
    slot, header = found
    try:
        yield slot, header, slot.read_metadata(header)
    finally:
        slot.close()

_MADV_POPULATE_WRITE = 23
_FAULT_CHUNK = 4 << 20


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    """libc's ``madvise`` through ctypes (which releases the GIL around it: the copy runs meanwhile)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _torch() -> Any:
    import torch

    return torch


def _check_owner(path: str, fd: int) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise SharedMemoryError(
            f"shared-memory slot {path} is owned by uid {st.st_uid} with mode "
            f"{oct(stat.S_IMODE(st.st_mode))}; expected uid {os.getuid()} and mode 0600. "
            "Another user or job is using this name: set a distinct job_id."
        )


def _open_or_create(path: str) -> tuple[int, bool]:
    """Open ``path`` read-write, creating it with mode 0600; also say whether this call created it."""
    flags = os.O_RDWR | os.O_NOFOLLOW
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            pass
        except OSError as exc:
            raise SharedMemoryError(f"cannot create shared-memory slot {path}: {exc}") from exc
        try:
            return os.open(path, flags), False
        except FileNotFoundError:  # removed in between: create it
            continue
        except OSError as exc:
            raise SharedMemoryError(f"cannot open shared-memory slot {path}: {exc}") from exc


def _unlink_if_same(path: str, fd: int) -> None:
    """Remove ``path`` if it still names the file open as ``fd``."""
    with contextlib.suppress(OSError):
        if same_file(fd, path):
            os.unlink(path)


_SIZE_REFUSED = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT)
"""What a file system answers when it cannot give a file that many bytes."""


def _grow(path: str, fd: int, size: int, min_size: int) -> int:
    new_size = max(int(min_size * GROWTH), HEADER_SIZE)
    new_size = (new_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    free = shm_free_bytes(os.path.dirname(path))
    if new_size - size > free:
        raise SharedMemoryError(
            f"not enough shared memory for slot {path}: it needs {new_size - size} more bytes, "
            f"{os.path.dirname(path)} has {free} free. Give the container a larger /dev/shm "
            "(docker --shm-size, a Kubernetes memory-backed emptyDir) or save less per rank."
        )
    try:
        os.posix_fallocate(fd, 0, new_size)
    except OSError as exc:
        if exc.errno in _SIZE_REFUSED:  # EFBIG: RLIMIT_FSIZE (the process also gets SIGXFSZ, ignored by Python)
            os.ftruncate(fd, size)
            raise SharedMemoryError(
                f"shared memory ran out while growing slot {path} to {new_size} bytes: {exc}"
            ) from exc
        try:  # no fallocate on this file system: size it sparsely (the mapping faults pages in)
            os.ftruncate(fd, new_size)
        except OSError as exc2:
            raise SharedMemoryError(f"cannot grow shared-memory slot {path} to {new_size} bytes: {exc2}") from exc2
    logger.debug("slot %s grown from %d to %d bytes", path, size, new_size)
    return new_size
