"""Storage backends: where committed checkpoints live.

A :class:`Storage` is addressed with paths relative to its root, always with ``/`` separators.
Call order for one file: ``open_write(path)`` (a context manager that publishes the file
atomically when it closes without error: temporary name, fsync, rename), then other ranks or the
committer see it through ``exists``/``list``. ``remove`` and ``rename`` serve the committer and
retention. Every method raises :class:`~flashckpt_integrations.errors.StorageError` with the
path and the cause.

Backends are picked from a URL by :func:`storage_from_url`: local paths and ``file://`` give
:class:`LocalStorage`, any other scheme goes to a registered factory, or to
:class:`FsspecStorage` when fsspec knows the scheme. Users plug in their own backend with
:func:`register_storage` or the ``flashckpt_integrations.storage`` entry-point group.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib
import io
import logging
import mmap
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol, runtime_checkable

from .. import knobs
from .._utils import pagecache
from ..errors import StorageError, missing_dependency

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "flashckpt_integrations.storage"


@runtime_checkable
class Storage(Protocol):
    """What the saver, the committer and the loaders need from a storage backend."""

    url: str

    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open ``path`` for writing; the file appears under its name only on a clean close."""

    def open_read(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open ``path`` for reading."""

    def read(self, path: str) -> bytes:
        """Return the whole content of ``path``."""

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (file or directory)."""

    def list(self, path: str) -> list[str]:
        """Names (not paths) directly under directory ``path``; empty when it does not exist."""

    def remove(self, path: str) -> None:
        """Remove the file or the directory tree at ``path``; a missing path is not an error."""

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` (a file or a directory); ``dst`` must not exist."""

    def size(self, path: str) -> int:
        """Size of file ``path`` in bytes."""


def write_bytes(storage: Storage, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with storage.open_write(path) as f:
        f.write(data)


def create_exclusive(storage: Storage, path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` only if nothing is there yet; True when this call created it.

    Atomic on local file systems (a hard link of a durable temporary) and on object stores with
    conditional writes (``If-None-Match``); a backend without ``create`` gets a check and a write.
    """
    create = getattr(storage, "create", None)
    if create is not None:
        return bool(create(path, data))
    if storage.exists(path):
        return False
    write_bytes(storage, path, data)
    return True


def remove_stale_temporaries(storage: Storage, paths: list[str]) -> None:
    """Remove what writers killed mid-write left beside ``paths``: their temporary siblings
    (``.name.tmp-*`` locally, ``name.tmp-*`` on object stores). One listing per directory."""
    by_parent: dict[str, set[str]] = {}
    for path in paths:
        parent, _, name = path.rpartition("/")
        by_parent.setdefault(parent, set()).add(name)
    for parent, names in by_parent.items():
        for entry in storage.list(parent):
            stem = entry.removeprefix(".").partition(".tmp-")[0]
            if ".tmp-" in entry and stem in names:
                storage.remove(f"{parent}/{entry}" if parent else entry)


def _wrap(op: str, path: str, exc: BaseException) -> StorageError:
    hint = ""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        hint = " The storage is full: free space or point the checkpoint directory elsewhere."
    elif isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " The checkpoint directory is not writable by this user."
    return StorageError(f"storage {op} of {path!r} failed: {exc}.{hint}")


class LocalStorage:
    """POSIX file system storage: temporary file, fsync, rename, fsync of the directory.

    Checkpoint files are written with ``O_DIRECT`` through an aligned buffer where the file system
    takes it (:class:`_DirectWrite`), else through the page cache with early writeback
    (:class:`_WriteBehind`).
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        final = self._abs(path)
        parent = os.path.dirname(final)
        tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(parent, exist_ok=True)
            direct = _DirectWrite.open(tmp)
            f = direct or open(tmp, "wb")  # noqa: SIM115 - closed below, on every path
        except OSError as exc:
            raise _wrap("write", path, exc) from exc
        try:
            yield direct or _WriteBehind(f)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.rename(tmp, final)
            _fsync_dir(parent)
        except BaseException as exc:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise _wrap("write", path, exc) from exc
            raise

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[IO[bytes]]:
        try:
            f = open(self._abs(path), "rb")  # noqa: SIM115
        except OSError as exc:
            raise _wrap("read", path, exc) from exc
        with f:
            yield f

    def read(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def open_ranges(self, path: str) -> LocalRanges:
        """``path`` for large positioned reads into aligned buffers (see :mod:`.reading`)."""
        try:
            return LocalRanges(self._abs(path))
        except OSError as exc:
            raise _wrap("read", path, exc) from exc

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _wrap("list", path, exc) from exc

    def remove(self, path: str) -> None:
        target = self._abs(path)
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _wrap("remove", path, exc) from exc

    def rename(self, src: str, dst: str) -> None:
        try:
            if os.path.exists(self._abs(dst)):
                raise FileExistsError(errno.EEXIST, "destination exists", dst)
            os.makedirs(os.path.dirname(self._abs(dst)), exist_ok=True)
            os.rename(self._abs(src), self._abs(dst))
            _fsync_dir(os.path.dirname(self._abs(dst)))
        except OSError as exc:
            raise _wrap("rename", src, exc) from exc

    def create(self, path: str, data: bytes) -> bool:
        """Publish ``data`` at ``path`` unless it exists (link(2) of a durable temporary)."""
        final = self._abs(path)
        parent = os.path.dirname(final)
        tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(parent, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            _fsync_dir(parent)
            return True
        except OSError as exc:
            raise _wrap("create", path, exc) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(self._abs(path))
        except OSError as exc:
            raise _wrap("stat", path, exc) from exc


class _WriteBehind:
    """A file wrapper that starts the disk writeback of each 32 MiB written, without waiting.

    The final ``fsync`` then has little left to flush: writing and the disk work side by side
    (0.26 s against 0.40 s for 512 MiB on this project's test machines). Linux only; elsewhere
    a plain pass-through.
    """

    CHUNK = 32 << 20

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._written = 0
        self._started = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._written += n
        if _sync_file_range is not None and self._written - self._started >= self.CHUNK:
            self._f.flush()
            _sync_file_range(self._f.fileno(), self._started, self._written - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = self._written
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class _DirectWrite:
    """A write-only file that bypasses the page cache: ``O_DIRECT`` writes of an aligned buffer.

    Buffered writes of a checkpoint cost the saver's host about as much kernel time as the copy
    into the page cache and its writeback take (0.1-0.6 s of CPU per 229 MiB here), and fill the
    page cache with files nobody reads soon; through ``O_DIRECT`` the same file costs a copy into
    this buffer and 0.01-0.03 s of kernel time. The data is gathered into an 8 MiB page-aligned
    buffer and written a full buffer at a time; :meth:`flush` writes what is left, the last block
    padded with zeros, and truncates the file to its size. Writing resumes only after a flush when
    the data so far ends on a block boundary, so ``flush`` is meant once, at the end (as
    :meth:`LocalStorage.open_write` does). A file system that refuses ``O_DIRECT`` at open gets
    the buffered path; one that refuses it at the first write has the flag cleared and the data
    written through the page cache.
    """

    BUFFER = 8 << 20
    ALIGN = 4096
    _supported: dict[int, bool] = {}  # st_dev -> took O_DIRECT

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = mmap.mmap(-1, self.BUFFER)
        self._view = memoryview(self._buffer)
        self._fill = 0
        self._size = 0
        self._direct = True
        self.closed = False

    @classmethod
    def open(cls, path: str) -> _DirectWrite | None:
        """The file at ``path``, created for ``O_DIRECT`` writing; None where that is not to be had."""
        if not hasattr(os, "O_DIRECT") or knobs.get(knobs.DIRECT_IO, "1") == "0":
            return None
        dev = os.stat(os.path.dirname(path) or ".").st_dev
        if cls._supported.get(dev) is False:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            cls._supported[dev] = False  # tmpfs before Linux 6.6, some FUSE and network file systems
            return None
        cls._supported[dev] = True
        return cls(fd)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, done = len(view), 0
        if not self._direct:
            self._write_all(view)
            return n
        while done < n:
            take = min(n - done, self.BUFFER - self._fill)
            self._view[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == self.BUFFER:
                self._drain(self.BUFFER)
        return n

    def _drain(self, nbytes: int) -> None:
        self._write_all(self._view[:nbytes])
        self._fill = 0

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self._direct = False

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                written = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()  # refused at a write: the rest (what was not written yet) goes buffered
                continue
            self._size += written
            view = view[written:]
            if view and self._direct and written % self.ALIGN:
                self._buffered()  # a short write off a block boundary: the rest goes buffered

    def flush(self) -> None:
        if not self._fill:
            return
        if not self._direct:
            self._write_all(self._view[:self._fill])
            self._fill = 0
            return
        size = self._size + self._fill
        padded = -(-self._fill // self.ALIGN) * self.ALIGN
        self._view[self._fill:padded] = bytes(padded - self._fill)
        self._drain(padded)
        os.ftruncate(self._fd, size)
        os.lseek(self._fd, size, os.SEEK_SET)
        self._size = size
        if size % self.ALIGN:
            self._buffered()  # later writes (none from open_write) start off a block boundary

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        os.close(self._fd)
        with contextlib.suppress(BufferError):  # a failed write's traceback may still hold a slice
            self._view.release()
            self._buffer.close()


class LocalRanges:
    """A local file opened for positioned reads (:mod:`.reading` reads it once, front to back,
    into page-aligned buffers).

    ``O_DIRECT`` where the file system takes it: the disk's bandwidth with nothing copied
    through the page cache, which checkpoints written with ``O_DIRECT`` are not in anyway. A
    file mostly in the page cache already (written buffered, or read recently) is read
    buffered instead, a copy out of memory that is faster than any disk; so is a small file,
    and every file where ``FLASHCKPT_DIRECT_IO=0``. ``align`` is what offsets and lengths of
    :meth:`readinto` must be multiples of (and buffers aligned to), except at the end of file.
    """

    DIRECT_MIN = 4 << 20
    DIRECT_ALIGN = 4096

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size
        self.align = 1
        self.direct = False
        if self.size >= self.DIRECT_MIN and hasattr(os, "O_DIRECT") and knobs.get(knobs.DIRECT_IO, "1") != "0":
            share = pagecache.cached_share(self._fd, self.size)
            if share is None or share < 0.5:
                self._open_direct()
        if not self.direct:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _open_direct(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return  # tmpfs before Linux 6.6, some FUSE and network file systems
        os.close(self._fd)
        self._fd, self.align, self.direct = fd, self.DIRECT_ALIGN, True

    def readinto(self, offset: int, view: memoryview) -> int:
        """Read from ``offset`` into ``view`` until it is full or the file ends; the bytes read.
        A file system that took ``O_DIRECT`` at open but refuses it on a read is read buffered."""
        got = 0
        try:
            while got < len(view):
                try:
                    n = os.preadv(self._fd, [view[got:]], offset + got)
                except OSError as exc:
                    if not (self.direct and exc.errno == errno.EINVAL):
                        raise
                    self._buffered()
                    continue
                got += n
                if n == 0 or offset + got >= self.size:
                    break
        except OSError as exc:
            raise _wrap("read", self.path, exc) from exc
        return got

    def _buffered(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        os.close(self._fd)
        self._fd, self.align, self.direct = fd, 1, False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = _load_sync_file_range()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecRanges:
    """Positioned reads of one object: each read is split into ranged GETs of ``PART`` bytes that
    run in parallel (object stores serve one connection at a fraction of their bandwidth), on the
    file system's own event loop when it is asynchronous (``cat_ranges``: s3fs, gcsfs, adlfs),
    else on threads. A read larger than one part (the restore's read-ahead asks for ``chunk``)
    is several requests in flight at once."""

    align = 1
    chunk = 32 << 20
    """The read size a sequential reader should use here (:mod:`.reading`): ``PARALLEL`` parts."""
    PART = 8 << 20
    PARALLEL = 4

    def __init__(self, fs: Any, full_path: str, path: str) -> None:
        self.fs, self.full_path, self.path = fs, full_path, path
        try:
            self.size = int(fs.size(full_path))
        except Exception as exc:
            raise _wrap("stat", path, exc) from exc
        self._pool: Any = None

    def readinto(self, offset: int, view: memoryview) -> int:
        end = min(offset + len(view), self.size)
        if end <= offset:
            return 0
        starts = list(range(offset, end, self.PART))
        ends = [min(start + self.PART, end) for start in starts]
        try:
            if len(starts) == 1:
                parts = [self.fs.cat_file(self.full_path, start=starts[0], end=ends[0])]
            elif getattr(self.fs, "async_impl", False):
                parts = self.fs.cat_ranges([self.full_path] * len(starts), starts, ends, on_error="raise")
            else:
                parts = list(self._threads().map(lambda r: self.fs.cat_file(self.full_path, start=r[0], end=r[1]),
                                                 zip(starts, ends)))
        except Exception as exc:
            raise _wrap("read", self.path, exc) from exc
        got = 0
        for start, data in zip(starts, parts):
            if start - offset != got:  # a short part before the end of the object
                break
            view[got:got + len(data)] = data
            got += len(data)
        return got

    def _threads(self) -> Any:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.PARALLEL, thread_name_prefix="flashckpt-get")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> FsspecRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FsspecStorage:
    """Any fsspec file system (``s3://``, ``gs://``, ``hdfs://``, ``memory://`` ...).

    Object stores publish an object atomically when its upload completes, so files are written
    under their final name there; other file systems get a temporary name and a move.
    """

    _ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "memory"}

    def __init__(self, url: str, fs: Any = None, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise missing_dependency("fsspec", "s3") from exc
        try:
            if fs is None:
                fs, root = fsspec.core.url_to_fs(url, **storage_options)
            else:
                root = fs._strip_protocol(url)
        except ImportError as exc:
            raise missing_dependency(f"the fsspec backend for {url!r} ({exc})", "s3") from exc
        self.fs = fs
        self.url = url
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._atomic_put = bool(self._ATOMIC_PUT.intersection(protocols))

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        final = self._abs(path)
        target = final if self._atomic_put else f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        buf = io.BytesIO() if self._atomic_put else None
        try:
            if buf is None:
                self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            f = buf if buf is not None else self.fs.open(target, "wb")
        except Exception as exc:
            raise _wrap("write", path, exc) from exc
        try:
            yield f
            if buf is not None:
                self.fs.pipe_file(final, buf.getvalue())
            else:
                f.close()
                self.fs.mv(target, final)
        except Exception as exc:
            if buf is None:
                with contextlib.suppress(Exception):
                    f.close()
                with contextlib.suppress(Exception):
                    self.fs.rm(target)
            if isinstance(exc, StorageError):
                raise
            raise _wrap("write", path, exc) from exc

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[IO[bytes]]:
        try:
            f = self.fs.open(self._abs(path), "rb")
        except Exception as exc:
            raise _wrap("read", path, exc) from exc
        with f:
            yield f

    def read(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(self._abs(path))
        except Exception as exc:
            raise _wrap("read", path, exc) from exc

    def open_ranges(self, path: str) -> FsspecRanges:
        """``path`` for positioned reads, each split into ranged GETs sent in parallel (see :class:`FsspecRanges`)."""
        return FsspecRanges(self.fs, self._abs(path), path)

    def _fresh(self, path: str) -> str:
        """The absolute path, with fsspec's listing cache for it dropped: other processes
        (the saver, other nodes) change the store, and a stale cache would hide a commit."""
        full = self._abs(path)
        self.fs.invalidate_cache(full)
        return full

    def exists(self, path: str) -> bool:
        try:
            return self.fs.exists(self._fresh(path))
        except Exception as exc:
            raise _wrap("stat", path, exc) from exc

    def list(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._fresh(path), detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise _wrap("list", path, exc) from exc
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def remove(self, path: str) -> None:
        try:
            if self.fs.exists(self._abs(path)):
                self.fs.rm(self._abs(path), recursive=True)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise _wrap("remove", path, exc) from exc

    def rename(self, src: str, dst: str) -> None:
        """Move a file or a directory tree. On an object store: copy every object, then delete
        the originals (no directory objects are assumed to exist)."""
        try:
            if self.fs.exists(self._fresh(dst)):
                raise FileExistsError(errno.EEXIST, "destination exists", dst)
            if not self._atomic_put:
                self.fs.mv(self._abs(src), self._abs(dst), recursive=True)
                return
            source = self._fresh(src)
            keys = self.fs.find(source)
            if not keys:
                raise FileNotFoundError(errno.ENOENT, "nothing to move", src)
            for key in keys:
                self.fs.copy(key, self._abs(dst) + key[len(source):])
            self.fs.rm(keys)
            self.fs.invalidate_cache(source)
            self.fs.invalidate_cache(self._abs(dst))
        except Exception as exc:
            raise _wrap("rename", src, exc) from exc

    def create(self, path: str, data: bytes) -> bool:
        """Publish ``data`` at ``path`` unless it exists: a conditional put where the backend has one."""
        full = self._fresh(path)
        try:
            if not self._atomic_put:
                self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(full, data, mode="create")
            return True
        except FileExistsError:
            return False
        except TypeError:  # a backend without modes: check, then write
            pass
        except Exception as exc:
            raise _wrap("create", path, exc) from exc
        if self.exists(path):
            return False
        write_bytes(self, path, data)
        return True

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._fresh(path)))
        except Exception as exc:
            raise _wrap("stat", path, exc) from exc


StorageFactory = Callable[..., Storage]
_REGISTRY: dict[str, StorageFactory] = {}


def register_storage(scheme: str, factory: StorageFactory) -> None:
    """Make ``scheme://...`` URLs open with ``factory(url, **storage_options)``.

    A factory registered here is visible in this process only. The saver runs in its own
    process, so for it to see a custom backend, publish the factory in the
    ``flashckpt_integrations.storage`` entry-point group, or pass ``storage_factory`` as an
    importable ``"module:attribute"`` string.
    """
    if not scheme or "://" in scheme:
        raise ValueError(f"scheme must be a bare name such as 's3', got {scheme!r}")
    _REGISTRY[scheme] = factory


def _entry_point_factory(scheme: str) -> StorageFactory | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            return ep.load()
    return None


def import_object(spec: str) -> Any:
    """Import ``"module:attribute"``."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"expected 'module:attribute', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def storage_from_url(
    url: str, storage_options: dict[str, Any] | None = None, factory: str | None = None
) -> Storage:
    """Open the storage for ``url``; ``factory`` ("module:attribute") overrides the lookup."""
    options = dict(storage_options or {})
    if factory:
        return import_object(factory)(url, **options)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in ("", "file"):
        return LocalStorage(url[len("file://"):] if scheme else url)
    chosen = _REGISTRY.get(scheme) or _entry_point_factory(scheme)
    if chosen is not None:
        return chosen(url, **options)
    return FsspecStorage(url, **options)
