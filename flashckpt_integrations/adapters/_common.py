"""Helpers shared by the adapters: which snapshot to resume from, how a resume and a save are
reported to the core and the log, small files made by stock code, and the collectives of the
adapters' own (a check-in that fails instead of hanging, a broadcast of bytes)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core import collectives, reshard
from ..core.checkpointer import Checkpointer
from ..core.results import SaveResult, SaveStatus
from ..core.state import Codec, FileSpec
from ..errors import CheckpointNotFoundError, FlashCkptError

logger = logging.getLogger(__name__)


def newest_memory_step(ck: Checkpointer, steps: list[int] | None = None) -> int | None:
    """The step ``ck.load()`` would restore from memory (collective), or None.

    Mirrors the rule of ``Checkpointer.load``: a step held complete by every rank and at least as
    new as the newest commit; decided without reading anything from storage. With peer replicas,
    a rank whose node lost its memory first fetches that step from a peer (``recover_replicas``).
    ``steps``: this rank's candidates, when an adapter accepts only some of its memory snapshots
    (default: all; an adapter that passes them calls ``recover_replicas`` before choosing them).
    The step is verified on every rank before it is returned (``ck.check_memory``): a snapshot
    that fails is discarded and the next newest step every rank holds is tried.
    """
    if steps is None:
        ck.recover_replicas()
    committed = ck.committed_steps()
    candidates = None if steps is None else set(steps)
    while True:
        held = ck.memory_steps()
        mine = held if candidates is None else sorted(candidates & set(held))
        views = collectives.all_gather_object([mine, committed[-1] if committed else None],
                                              ck.world_size, ck.process_group)
        common = set.intersection(*(set(v[0]) for v in views))
        newest_commit = views[0][1]
        eligible = [s for s in common if newest_commit is None or s >= newest_commit]
        if not eligible:
            return None
        step = max(eligible)
        if ck.check_memory(step):
            return step
        if candidates is not None:
            candidates.discard(step)


def verified_choice(ck: Checkpointer, choose: Callable[[], tuple[int, str] | None]) -> tuple[int, str] | None:
    """``choose()`` (collective: ``(step, "memory" | "storage")`` or None) until its memory step
    verifies on every rank (``ck.check_memory``; a copy that fails is discarded, so the next
    choice differs)."""
    while True:
        chosen = choose()
        if chosen is None or chosen[1] != "memory" or ck.check_memory(chosen[0]):
            return chosen


def declare_resume(ck: Checkpointer, step: int, source: str = "storage", tag: Mapping[str, Any] | None = None
                   ) -> None:
    """Tell the core that this attempt resumed from ``step`` read by a framework's own loader (not
    ``ck.load()``), so that it continues that checkpoint's lineage (collective: every rank, before
    the first save; nothing happens when the attempt has decided already).

    ``source``: ``"memory"`` (this job's snapshot of ``step``, every rank holds it) or ``"storage"``
    (a commit; a step that flashckpt never committed, e.g. stock files, makes a run of its own).
    ``tag``: the lineage tag of a memory snapshot that is not this job's own (``reshard.Sources.tag``).
    """
    if source == "memory":
        ck.start_attempt(step, from_memory=True, tag=tag)
        return
    try:
        ck.start_attempt(step)
    except CheckpointNotFoundError:  # the same answer on every rank: they all read the same records
        ck.start_attempt(None)


def resharding_sources(ck: Checkpointer, committed: list[int], *, reshards: bool, framework: str
                       ) -> reshard.Sources | None:
    """The snapshots that a job of another number of ranks left in memory, of a step not older than the
    newest of ``committed``, when the state reshards (collective; ``reshard.open_sources``). Otherwise
    None, and rank 0 WARNs when memory holds a newer step that this state cannot be resharded from."""
    if reshards:
        return reshard.open_sources(ck, committed[-1] if committed else None)
    newer = reshard.newest_elsewhere(ck)
    if newer is None or (committed and newer[0] <= committed[-1]) or ck.rank != 0:
        return None
    logger.warning("flashckpt: shared memory holds step %d, saved by a job of %d ranks; this job has %d, and %s state "
                   "resumes from memory onto another number of ranks only as FSDP's SHARDED_STATE_DICT. %s",
                   newer[0], newer[1], ck.world_size, framework,
                   f"Resuming from committed step {committed[-1]}" if committed else "Starting afresh")
    return None


def step_destination(ck: Checkpointer, step: int) -> str:
    """The directory where ``step``'s checkpoint lands once committed (never a staging folder)."""
    path = ck.layout.step_path(step)
    return f"{ck.url.rstrip('/')}/{path}" if "://" in ck.url else os.path.join(ck.url, path)


def log_save(log: logging.Logger, rank: int, call: str, result: SaveResult, destination: str, held_s: float) -> None:
    """The one INFO line of a framework-level save: its step, status, where it lands, and how long
    the whole call held the training thread (building the state, planning, the copy)."""
    if result.status is SaveStatus.PERSISTING:
        where = f"to {destination}"
    elif result.status is SaveStatus.IN_MEMORY:
        where = "(memory only, not persisted)"
    else:
        where = f"(nothing saved for {destination})"
    log.info("[RANK %d] flashckpt: %s of step %d %s %s (training held %.3fs)", rank, call, result.step,
             result.status.value, where, held_s)


class _DropRecordsNaming(logging.Filter):
    """Drops log records whose message names ``path`` (a scratch folder users never see)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.path not in record.getMessage()
        except Exception:
            return True


@contextlib.contextmanager
def quiet_about(path: str, loggers: Iterable[str]) -> Iterator[None]:
    """While the block runs, drop the records of ``loggers`` (by name) that name ``path``; others pass."""
    drop = _DropRecordsNaming(path)
    chosen = [logging.getLogger(name) for name in loggers]
    for each in chosen:
        each.addFilter(drop)
    try:
        yield
    finally:
        for each in chosen:
            each.removeFilter(drop)


def share_from_rank0(files: dict[str, Any], rank: int, is_own: Callable[[str], bool]) -> dict[str, Any]:
    """Give every rank rank 0's files, except the per-rank ones (``is_own(name)``), which each rank keeps.

    Frameworks that write replicated state (weights, optimizer) from rank 0 only do the same in a
    snapshot; on a resume from memory the other ranks get it from rank 0 (collective).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return files
    shared = [{k: v for k, v in files.items() if not is_own(k)} if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return {**shared[0], **{k: v for k, v in files.items() if is_own(k)}}


def files_written_by(write: Callable[[str], Any], skip: Callable[[str], bool] = lambda _: False, *,
                     quiet: Iterable[str] = ()) -> dict[str, FileSpec]:
    """Let stock code ``write(directory)`` its files into a scratch folder; return them as byte files.

    For the small files (RNG states, configs, sampler states) whose exact content the framework
    defines: they are copied into the snapshot as they are. ``skip(relative_path)`` leaves files out.
    ``quiet``: names of the framework's loggers whose messages naming the scratch folder ("saved in
    /tmp/flashckpt-files-...") are dropped; that folder is not where the checkpoint goes.
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="flashckpt-files-") as scratch:
        with quiet_about(scratch, quiet):
            write(scratch)
        for root, _, names in os.walk(scratch):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, scratch).replace(os.sep, "/")
                if not skip(rel):
                    with open(path, "rb") as f:
                        out[rel] = FileSpec(f.read(), Codec.BYTES)
    return out


def write_byte_files(files: Mapping[str, Any], prefix: str) -> str:
    """Write the byte files of a snapshot into a new private folder (for stock loaders); return it."""
    path = tempfile.mkdtemp(prefix=prefix)
    for name, obj in files.items():
        if isinstance(obj, (bytes, bytearray)):
            target = os.path.join(path, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(obj)
    return path


# --- collectives -----------------------------------------------------------------------------


def broadcast_bytes(data: bytes | None, ck: Checkpointer, src: int = 0) -> bytes | None:
    """``data`` of rank ``src`` (group rank) on every rank; ``None`` travels as ``None``."""
    if ck.world_size == 1 or not dist.is_initialized():
        return data
    group = ck.process_group
    device = collectives.collective_device(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, global_src, group=group)
    n = int(size.item())
    if n < 0:
        return None
    if ck.rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        buffer = buffer.to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, global_src, group=group)
    if ck.rank == src:
        return data
    buffer = buffer.cpu()
    return ctypes.string_at(buffer.data_ptr(), n) if n else b""


_check_ins: dict[str, int] = {}
"""How many check-ins of each key this process made (the store keys of the next one count on)."""


def check_in(op: str, group: Any, timeout_s: float, vote: Any = None) -> list[Any]:
    """Every rank's ``vote`` (JSON), in group rank order, through the job's store.

    Fails within ``timeout_s`` naming the missing ranks, instead of hanging, when not every rank
    calls ``op``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [vote]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    key = f"flashckpt/{op}/{'-'.join(map(str, ranks[:4]))}/{len(ranks)}"
    _check_ins[key] = _check_ins.get(key, 0) + 1
    base = f"{key}/{_check_ins[key]}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{base}/{dist.get_rank()}", json.dumps(vote))
    names = [f"{base}/{r}" for r in ranks]
    try:  # the store answers as soon as the last rank's key is set: no polling delay
        store.wait(names, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError on a timeout
        missing = [r for r, name in zip(ranks, names) if not store.check([name])]
        if not missing:
            raise
        raise FlashCkptError(
            f"{op} is collective but ranks {missing} did not call it within {timeout_s:.0f}s (rank "
            f"{dist.get_rank()} did). Call it on every rank of the process group, at the same point."
        ) from exc
    return [json.loads(v) for v in store.multi_get(names)]
