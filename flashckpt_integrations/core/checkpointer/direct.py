"""Saving straight to storage from the training process, when shared memory is too small.

A rank whose slot cannot be created or grown (``/dev/shm`` too small, as Docker's default
64 MB is) does not drop a persisting save: it writes its files itself, through the same codecs
the saver uses, then its done marker, and rank 0 commits the step with the saver's own commit
protocol (every rank's marker, then the tracker and the commit record). The step is durable and
committed when ``save`` returns on rank 0 (on the other ranks, ``wait()`` polls for the commit).
Training is held for the whole write, and the state is staged in private memory (a ``memfd``,
which does not count against ``/dev/shm``'s size) so that the codecs read it as they read a
slot. Retention runs on a background thread, never on the training thread.

A memory-only save (``persist=False``) does not fall back: writing every snapshot to storage
would stall training far more than the snapshot saves; it fails with the reason instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from ..._utils.devices import synchronize_devices
from ...errors import SharedMemoryError
from .. import commit as commit_protocol
from ..layout import Layout, write_rank_done, write_rank_failed
from ..persister import Persister
from ..results import SaveResult, SaveStatus
from ..shm_buffer import Slot
from ..state import SnapshotPlan, copy_regions
from ..storage import Storage
from ..writing import write_file

logger = logging.getLogger(__name__)


def fallback(
    step: int, plan: SnapshotPlan, meta: dict[str, Any], persist: bool, error: SharedMemoryError, *, rank: int,
    storage: Storage, layout: Layout, retention: Executor, poll_commit: Callable[..., Any],
) -> SaveResult:
    """What ``save`` does when the rank's slot cannot hold the snapshot (``error`` says why).

    ``meta``: the snapshot's metadata, with the persist request the saver would have got (same
    seq, layout, retention); ``retention``: where the commit's retention pass runs;
    ``poll_commit``: how the result watches for the commit on ranks other than 0."""
    if not persist:
        return SaveResult(step, SaveStatus.FAILED, (
            f"{error} This memory-only save of step {step} was not kept; saves with persist=True "
            "are written straight to storage until shared memory is large enough."))
    logger.error("[RANK %d] %s Writing step %d straight to storage from the training process instead; "
                 "training waits until it is durable.", rank, error, step)
    request = meta["persist"]
    committer = Persister(lambda _request: storage, retention=retention)
    try:
        _persist(storage, layout, plan, request)
    except Exception as exc:
        reason = f"rank {rank} could not write step {step} straight to storage: {type(exc).__name__}: {exc}"
        logger.error("[RANK %d] %s", rank, reason)
        if rank == 0:
            committer.commit(request, reason)
        return SaveResult(step, SaveStatus.FAILED, reason)
    if rank == 0:
        committer.commit(request)
    durable: Future = Future()
    durable.set_result({"ok": True})
    return SaveResult(step, SaveStatus.PERSISTING, f"written straight to storage: {error}", durable=durable,
                      poll_commit=poll_commit)


def _persist(storage: Storage, layout: Layout, plan: SnapshotPlan, request: dict[str, Any]) -> None:
    """Write one rank's files and its done marker (or its failed marker), as the saver's Persister does."""
    try:
        base = commit_protocol.claim(storage, layout, request)
        entries = _write_files(storage, base, plan)
        write_rank_done(storage, layout, request, entries, base)
    except Exception as exc:
        write_rank_failed(storage, layout, request, exc)
        raise


def _write_files(storage: Storage, base: str, plan: SnapshotPlan) -> list[dict[str, Any]]:
    """Stage the snapshot in private memory and write each file from it with its codec."""
    end = plan.layout(0)
    metadata = plan.metadata()
    buffer = _private_buffer(end)
    try:
        for offset, blob in plan.blobs():
            buffer.write_blob(offset, blob)
        copy_regions(plan, buffer.buffer)
        synchronize_devices(plan)
        entries = []
        for fmeta in metadata["files"]:
            entry = write_file(storage, f"{base}/{fmeta['path']}", fmeta, metadata["regions"], buffer)
            entries.append({**entry, "path": fmeta["path"], "codec": fmeta["codec"]})
        return entries
    finally:
        buffer.close()


def _private_buffer(nbytes: int) -> Slot:
    """A slot-shaped mapping of private memory (a memfd; an unlinked temporary file without one)."""
    size = max(mmap.PAGESIZE, (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("flashckpt-direct", getattr(os, "MFD_CLOEXEC", 0))
    else:
        fd, path = tempfile.mkstemp(prefix="flashckpt-direct-")
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
        return Slot("<private memory>", fd, size, populate=False)
    except BaseException:
        os.close(fd)
        raise
