"""How much of a file the kernel's page cache holds (``mincore`` over a read-only mapping).

A reader asks :func:`cached_share` before it picks ``O_DIRECT`` (the disk's speed, no copy
into the cache) or a buffered read (a copy out of memory, much faster while the pages are
there). Mapping a file touches none of its pages; ``mincore`` only reads the page tables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os

PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=1)
def _mincore() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    return libc


SAMPLES = 64
"""Windows a large file's residency is sampled at (evenly spaced), of :data:`WINDOW` bytes each."""
WINDOW = 64 * PAGE


def cached_share(fd: int, size: int) -> float | None:
    """The share (0 to 1) of the first ``size`` bytes of open file ``fd`` that sit in the page
    cache (sampled: :data:`SAMPLES` windows of a file larger than they cover together); None
    where the kernel cannot say (no ``mincore``, a file that cannot be mapped)."""
    libc = _mincore()
    if libc is None or size <= 0:
        return None
    length = (size + PAGE - 1) // PAGE * PAGE
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        if length <= SAMPLES * WINDOW:
            windows = [(0, length)]
        else:
            stride = (length - WINDOW) // (SAMPLES - 1) // PAGE * PAGE
            windows = [(i * stride, WINDOW) for i in range(SAMPLES)]
        resident = total = 0
        vector = ctypes.create_string_buffer(max(n for _, n in windows) // PAGE)
        for start, n in windows:
            pages = n // PAGE
            if libc.mincore(addr + start, n, vector) != 0:
                return None
            resident += pages - vector.raw[:pages].count(b"\x00")
            total += pages
        return resident / total
    finally:
        libc.munmap(addr, length)


def drop(fd: int) -> None:
    """Ask the kernel to drop the clean cached pages of ``fd`` (benchmarks, tests)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
