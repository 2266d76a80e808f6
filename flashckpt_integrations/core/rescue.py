"""Persist the newest in-memory step on demand: after a job stopped, or when a launcher sees a
worker fail or is told to stop.

Call order: find the job's slots on this node (:func:`job_slots` from the checkpoint directory
and job id, or :func:`run_dir_slots` from the saver's run directory) and, when another node is
gone, the peer replicas this node holds for its ranks (:func:`job_replicas`), then
:func:`persist_newest`. It picks the newest step that every local rank holds complete in
memory and, when that step is newer than the newest commit on storage, writes every local
rank's files and, on the node that holds rank 0, commits the step. On several nodes, run it on
each: every node persists its own ranks and rank 0's node commits once all markers are there.

It runs the saver's own ``persist`` and ``commit`` in this process: the same per-slot lock and
the same done markers (which name the snapshot's seq), so a saver persisting the same snapshot
at the same time is waited for and not repeated, and a committed step is never written into.
Every slot's metadata carries its persist target (``persist_target``), so memory-only
snapshots can be persisted too.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

from .. import knobs
from ..errors import FlashCkptError
from . import lineage
from .client import job_id_for, job_key
from .layout import (
    COMMITTED,
    FAILED,
    Layout,
    commit_record,
    commit_records,
    committed_steps,
    failure_record,
)
from .persister import Persister
from .protocol import read_slot_records
from .replication import replica_paths, verify
from .shm_buffer import Slot, SlotState, complete_snapshot
from .storage import Storage, storage_from_url
from .verify import TABLE_WAIT_S, check_slot

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""``progress(bytes_written, bytes_expected)``, called as files are written (from worker threads)."""

_SLOT_RE = re.compile(r"-r(\d+)-(\d+)$")


class RescueStatus(str, Enum):
    COMMITTED = "committed"
    """The step is committed on storage (by this call, or by the job's saver meanwhile)."""
    PERSISTED = "persisted"
    """This node's ranks are durable; the node that holds rank 0 commits the step."""
    NOTHING = "nothing"
    """Nothing to persist: ``reason`` says why (e.g. memory holds nothing newer than storage)."""
    FAILED = "failed"
    """Persisting or committing failed: ``reason`` says why; earlier commits are intact."""


@dataclass
class RescueResult:
    status: RescueStatus
    reason: str
    step: int | None = None
    ranks: list[int] = field(default_factory=list)
    """The local ranks whose files of ``step`` were written (or found durable already)."""
    bytes_written: int = 0

    @property
    def ok(self) -> bool:
        return self.status is not RescueStatus.FAILED


@dataclass(frozen=True)
class Snapshot:
    """One complete snapshot in one slot."""

    rank: int
    step: int
    seq: int
    path: str
    meta: dict[str, Any]

    @property
    def target(self) -> dict[str, Any] | None:
        """Where it is persisted: the slot's persist target (or its persist request)."""
        return self.meta.get("persist_target") or self.meta.get("persist")

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.meta["regions"]) + sum(f["blob"][1] for f in self.meta["files"])


# --- finding a job's slots ----------------------------------------------------------------


def job_slots(checkpoint_dir: str | os.PathLike, job_id: str | None = None,
              shm_dir: str | None = None) -> dict[int, list[str]]:
    """This host's slot files of the job that saves to ``checkpoint_dir``, by rank.

    ``job_id`` is the job's id when it set one (``CheckpointerConfig.job_id`` or
    ``$FLASHCKPT_JOB_ID``); by default a job is named by its checkpoint directory.
    """
    key = _job_key(checkpoint_dir, job_id)
    shm_dir = shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm")
    found: dict[int, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{key}-r*-*"))):
        match = _SLOT_RE.search(path)
        if match:
            found.setdefault(int(match.group(1)), []).append(path)
    return found


def job_replicas(checkpoint_dir: str | os.PathLike, job_id: str | None = None,
                 shm_dir: str | None = None) -> dict[int, list[str]]:
    """The replica slots this host holds for other nodes' ranks of the job, by rank (peer replicas:
    ``CheckpointerConfig.replicas``)."""
    return replica_paths(shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm"), _job_key(checkpoint_dir, job_id))


def _job_key(checkpoint_dir: str | os.PathLike, job_id: str | None) -> str:
    """The key that names the job's slots: its id, else its checkpoint directory (as a Checkpointer has it)."""
    url = os.fspath(checkpoint_dir)
    url = url if "://" in url else os.path.abspath(os.path.expanduser(url))
    return job_key(job_id_for(url, job_id))


def run_dir_slots(run_dir: str) -> dict[int, list[str]]:
    """The slot files that the ranks of one node recorded in the saver's run directory, by rank."""
    return {rank: [p for p in paths if os.path.exists(p)]
            for rank, paths in read_slot_records(run_dir, warn=True).items()}


def read_snapshots(slots: Mapping[int, Sequence[str]]) -> tuple[dict[int, dict[int, Snapshot]], list[str]]:
    """Complete, checksum-verified snapshots by rank and step (the newest seq per step), and notes
    on the slots that could not be used."""
    held: dict[int, dict[int, Snapshot]] = {}
    notes: list[str] = []
    for rank, paths in slots.items():
        held[rank] = {}
        for path in paths:
            try:
                snapshot = _read_slot(rank, path)
            except FlashCkptError as exc:
                notes.append(f"rank {rank}: {exc}")
                continue
            known = held[rank].get(snapshot.step) if snapshot is not None else None
            if snapshot is not None and (known is None or known.seq < snapshot.seq):
                held[rank][snapshot.step] = snapshot
    return held, notes


def _read_slot(rank: int, path: str) -> Snapshot | None:
    with complete_snapshot(path) as found:
        if found is None:
            return None
        _, header, meta = found
    if meta.get("rank") != rank:
        raise FlashCkptError(f"slot {path} holds a snapshot of rank {meta.get('rank')}, not {rank}")
    return Snapshot(rank, header.step, header.seq, path, meta)


# --- choosing and persisting --------------------------------------------------------------


def choose_step(held: Mapping[int, Mapping[int, Snapshot]], newest_commit: int | None) -> tuple[int | None, str]:
    """The newest step every local rank holds and that is newer than ``newest_commit``, and why."""
    ranks = sorted(held)
    common = set.intersection(*(set(held[r]) for r in ranks)) if ranks else set()
    newer = sorted(s for s in common if newest_commit is None or s > newest_commit)
    partial = sorted(s for r in ranks for s in held[r] if s not in common
                     and (newest_commit is None or s > newest_commit) and (not newer or s > newer[-1]))
    notes = ""
    if partial:
        step = partial[-1]
        have = [r for r in ranks if step in held[r]]
        notes = (f"step {step} is held complete by ranks {have} only (ranks "
                 f"{[r for r in ranks if r not in have]} lack it), so it is not persisted")
    if newer:
        return newer[-1], notes
    if notes:
        return None, notes
    if not any(held[r] for r in ranks):
        return None, "no complete snapshot of this job in this node's shared memory"
    newest_common = max(common) if common else None
    return None, (f"the newest step every local rank holds in memory ({newest_common}) is not newer than "
                  f"the newest commit ({newest_commit}); nothing to persist")


def persist_newest(slots: Mapping[int, Sequence[str]], *, replicas: Mapping[int, Sequence[str]] | None = None,
                   progress: Progress | None = None, commit_timeout: float | None = None) -> RescueResult:
    """Persist (and, on rank 0's node, commit) the newest step every local rank holds in memory.

    ``slots``: this node's slot files by rank (:func:`job_slots`, :func:`run_dir_slots`).
    ``replicas``: replica slots by rank (:func:`job_replicas`), for ranks whose node is gone: each
    rank without a slot of its own here counts as local through its replicas, verified against
    their checksums first, so that this node persists its step too (and, holding rank 0,
    commits it). ``commit_timeout`` overrides how long rank 0's node waits for other nodes' files.
    """
    slots, replica_notes = _with_replicas(slots, replicas or {})
    held, notes = read_snapshots(slots)
    notes = replica_notes + notes
    for note in notes:
        logger.warning("%s", note)
    snapshots = [s for by_step in held.values() for s in by_step.values()]
    if not snapshots:
        reason = "no complete snapshot of this job in this node's shared memory"
        return RescueResult(RescueStatus.NOTHING, "; ".join([reason, *notes]))
    target = max(snapshots, key=lambda s: s.step).target
    if target is None:
        return RescueResult(RescueStatus.FAILED, "the snapshots carry no persist target (taken by an older "
                            "flashckpt-integrations); they can only be loaded by the job itself")
    storage = storage_from_url(target["root"], target.get("storage_options"), target.get("storage_factory"))
    newest = max(snapshots, key=lambda s: s.step)
    view = lineage.view_of(storage, newest.meta.get("tag"))  # commits of abandoned attempts do not count
    committed = sorted(s for s, record in commit_records(storage).items() if view.accepts(record, s))
    while True:  # never persist bytes that differ from what was saved: a bad copy is left out, choose again
        step, why = choose_step(held, committed[-1] if committed else None)
        if step is None:
            return RescueResult(RescueStatus.NOTHING, why)
        chosen = [held[rank][step] for rank in sorted(held)]
        bad = _unverified(chosen)
        if not bad:
            break
        for snapshot, problem in bad:
            logger.warning("rank %d's snapshot of step %d is not persisted: %s", snapshot.rank, step, problem)
            del held[snapshot.rank][step]
    mismatch = _mismatch(chosen)
    if mismatch:
        return RescueResult(RescueStatus.FAILED, mismatch, step)
    if why:
        logger.warning("%s; persisting step %d instead", why, step)
    result = _persist_and_commit(chosen, storage, progress, commit_timeout)
    if why and result.ok:
        result.reason += f" ({why})"
    return result


def _with_replicas(slots: Mapping[int, Sequence[str]], replicas: Mapping[int, Sequence[str]],
                   ) -> tuple[dict[int, list[str]], list[str]]:
    """``slots`` plus the intact replica slots of the ranks it lacks, and notes on the damaged ones."""
    merged = {rank: list(paths) for rank, paths in slots.items()}
    notes = []
    for rank, paths in replicas.items():
        if rank in merged:
            continue
        intact = []
        for path in paths:
            problem = verify(path)
            if problem is None:
                intact.append(path)
            elif "no complete replica" not in problem:
                notes.append(f"rank {rank}: {problem}")
        if intact:
            merged[rank] = intact
    return merged, notes


def _unverified(chosen: Sequence[Snapshot]) -> list[tuple[Snapshot, str]]:
    """The snapshots whose bytes do not match the checksums taken when they were saved (or have none)."""
    out = []
    for snapshot in chosen:
        found, deadline = check_slot(snapshot.path), time.monotonic() + TABLE_WAIT_S
        while found["status"] == "unverified" and time.monotonic() < deadline:
            time.sleep(0.02)
            found = check_slot(snapshot.path)
        if found["status"] != "ok" or found["step"] != snapshot.step:
            out.append((snapshot, found["detail"] or f"the slot now holds {found['status']} step {found['step']}"))
    return out


def _mismatch(chosen: Sequence[Snapshot]) -> str | None:
    """Why the ranks' snapshots of one step cannot make one checkpoint, or None."""
    roots = {(s.target or {}).get("root") for s in chosen}
    worlds = {s.meta.get("world_size") for s in chosen}
    if None in roots or len(roots) > 1:
        return f"the local ranks' snapshots of step {chosen[0].step} name different checkpoint directories {roots}"
    if len(worlds) > 1:
        return f"the local ranks' snapshots of step {chosen[0].step} were taken in jobs of sizes {sorted(worlds)}"
    return None


def _persist_and_commit(chosen: Sequence[Snapshot], storage: Storage, progress: Progress | None,
                        commit_timeout: float | None) -> RescueResult:
    step, ranks = chosen[0].step, [s.rank for s in chosen]
    requests = [_request(s, commit_timeout) for s in chosen]
    counter, opened = _ByteCounter(progress, sum(s.nbytes for s in chosen)), Persister()
    persister = Persister(lambda request: _CountingStorage(opened.storage(request), counter))

    def try_persist(request: dict[str, Any]) -> str | None:
        try:
            persister.persist(request)
        except Exception as exc:  # reported per rank below
            logger.error("rank %s could not persist step %s: %s", request["rank"], request["step"], exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    try:
        logger.info("persisting step %d of ranks %s from memory", step, ranks)
        with ThreadPoolExecutor(min(8, len(requests)), thread_name_prefix="flashckpt-rescue") as pool:
            errors = dict(zip(ranks, pool.map(try_persist, requests)))
        failed = {r: e for r, e in errors.items() if e is not None}
        if 0 in ranks:
            persister.commit(requests[ranks.index(0)], failed.get(0))
        elif failed:
            return RescueResult(RescueStatus.FAILED, f"ranks {sorted(failed)} could not persist step {step}: "
                                f"{failed}", step, ranks, counter.done)
    finally:
        persister.close()
    written = counter.done  # the ranks' files (and the tracker, when this node committed)
    if commit_record(storage, step) is not None:
        return RescueResult(RescueStatus.COMMITTED, f"step {step} is committed (ranks {ranks} persisted from "
                            "memory on this node)", step, ranks, written)
    if 0 in ranks:
        failure = failure_record(storage, step)
        why = failure["reason"] if failure else "no commit record appeared"
        return RescueResult(RescueStatus.FAILED, f"step {step} was not committed: {why}", step, ranks, written)
    return RescueResult(RescueStatus.PERSISTED, f"ranks {ranks} of step {step} are durable; the node that holds "
                        "rank 0 commits the step (persist there too)", step, ranks, written)


def _request(snapshot: Snapshot, commit_timeout: float | None) -> dict[str, Any]:
    tag = snapshot.meta.get("tag") or {}
    asked = snapshot.meta.get("persist") or {}  # a snapshot that was to be persisted keeps its save id
    sid = asked.get("sid") or (f"a{tag['lineage']}r" if "lineage" in tag else "")
    request = {**snapshot.target, "rank": snapshot.rank, "world_size": snapshot.meta["world_size"],
               "step": snapshot.step, "seq": snapshot.seq, "slot": snapshot.path, "recovered": True,
               "sid": sid, "tag": tag}
    if commit_timeout is not None:
        request["commit_timeout"] = commit_timeout
    return request


class _ByteCounter:
    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            done = self.done
        if self.progress is not None:
            self.progress(done, max(self.total, done))


class _CountingStorage:
    """Delegates to a storage and counts the bytes written into data files (not markers)."""

    def __init__(self, inner: Storage, counter: _ByteCounter) -> None:
        self._inner = inner
        self._counter = counter
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        with self._inner.open_write(path) as f:
            yield _CountingFile(f, self._counter) if Layout.is_data_file(path) else f


class _CountingFile:
    def __init__(self, f: IO[bytes], counter: _ByteCounter) -> None:
        self._f = f
        self._counter = counter

    def write(self, data: Any) -> int:
        written = self._f.write(data)
        self._counter.add(memoryview(data).nbytes)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# --- what is still in flight --------------------------------------------------------------


def in_flight(slots: Mapping[int, Sequence[str]]) -> list[str]:
    """What a saver still has to finish for these slots, in words (empty: nothing).

    A persist was asked for and is not done, or a persisted step newer than the newest commit
    has neither a commit record nor a failure record yet.
    """
    pending: list[str] = []
    storages: dict[str, tuple[Storage, list[int]]] = {}
    for rank, paths in slots.items():
        for path in paths:
            try:
                state = _persist_state(path)
            except FlashCkptError as exc:
                logger.debug("ignoring slot %s: %s", path, exc)
                continue
            if state is None:
                continue
            step, done, target = state
            if not done:
                pending.append(f"rank {rank} step {step} is being persisted")
                continue
            if target["root"] not in storages:
                storage = storage_from_url(target["root"], target.get("storage_options"), target.get("storage_factory"))
                storages[target["root"]] = (storage, committed_steps(storage))
            storage, committed = storages[target["root"]]
            names = set(storage.list(Layout.marker_dir(step)))
            if (not committed or step > committed[-1]) and not names & {COMMITTED, FAILED}:
                pending.append(f"step {step} waits for its commit")
    return sorted(set(pending))


def _persist_state(path: str) -> tuple[int, bool, dict[str, Any]] | None:
    """(step, persisted, target) of a complete slot whose snapshot was to be persisted, else None."""
    slot = Slot.attach(path)
    if slot is None:
        return None
    try:
        header = slot.read_header()
        if header is None or header.state is not SlotState.COMPLETE or header.persist_req != header.seq:
            return None
        request = slot.read_metadata(header).get("persist")
    finally:
        slot.close()
    if request is None:
        return None
    return header.step, header.persist_done >= header.persist_req, request
