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
