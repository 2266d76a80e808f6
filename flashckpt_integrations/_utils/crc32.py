"""CRC-32 with the zip polynomial (what torch files, their records and rank markers carry), at
the speed this host allows: zlib-ng's (the ``zlib-ng`` package, a dependency: about 12 GiB/s on
one core here, with carry-less multiplication) else zlib's (about 3.5 GiB/s). Both give the
same values and release the GIL on large buffers, so a checksum runs beside a read or a write.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - the package is a dependency; a broken install is only slower
    from zlib import crc32

__all__ = ["crc32"]
