"""Probing advisory file locks that another process may hold."""

from __future__ import annotations

import fcntl
import os


def lock_held(path: str, *, exclusive_only: bool = False) -> bool:
    """Whether another process holds a ``flock`` on ``path`` (a missing file holds none).

    With ``exclusive_only``, only an exclusive lock counts (the probe asks for a shared one).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if exclusive_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``: a lock taken on a file that was
    unlinked (or replaced) meanwhile guards nothing, and is taken again on the new one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)
