"""Persist a rank's snapshot from its slot, commit a step, apply retention: the storage side of
a checkpoint, shared by the node's saver process (:mod:`.saver`), a training process whose
/dev/shm is too small (:mod:`.direct`) and ``flashckpt persist`` (:mod:`.rescue`).

Call order, per step: :meth:`Persister.persist` for each rank (its files, then its done marker
or failed marker); then, on the committer (the side of global rank 0), :meth:`Persister.commit`:
wait until every rank's marker exists (``give_way`` may end the wait early: its reason becomes
the step's failure record), switch the step in, ``answer``, then retention (:meth:`purge`).
Commits wait for their markers side by side; their switches and retention passes run one at a
time, so a commit held up by a lost rank never delays another save's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from .._utils.faults import fault_point
from ..errors import StorageError
from . import commit as commit_protocol
from . import lineage
from .layout import (
    COMMITTED,
    DELETING,
    Layout,
    commit_records,
    marked_steps,
    now,
    read_json,
    write_json,
    write_rank_done,
    write_rank_failed,
)
from .retention import RetentionPolicy
from .shm_buffer import Slot, SlotState
from .storage import ENTRY_POINT_GROUP, Storage, remove_stale_temporaries, storage_from_url
from .writing import write_file

logger = logging.getLogger(__name__)


class Persister:
    """Writes snapshots to storage and commits them (thread-safe: one thread per rank persists,
    any number of threads commit).

    ``open_storage(request)``: the storage a request names (default: opened from its ``root``,
    ``storage_options`` and ``storage_factory``, one instance per distinct storage).
    ``retention``: where retention passes run (default: on the committing thread).
    """

    def __init__(self, open_storage: Callable[[dict[str, Any]], Storage] | None = None,
                 retention: Executor | None = None) -> None:
        self._open_storage = open_storage
        self._retention = retention
        self._storages: dict[str, Storage] = {}
        self._storage_lock = threading.Lock()
        self._serial = threading.Lock()
        """Held by a commit's switch and by retention: one at a time, in the order they get here."""
        self.slots: dict[str, Slot] = {}
        """The slots mapped by persists, kept (pre-faulted) between persists of the same rank."""

    def storage(self, request: dict[str, Any]) -> Storage:
        if self._open_storage is not None:
            return self._open_storage(request)
        spec = [request["root"], request.get("storage_options"), request.get("storage_factory")]
        key = json.dumps(spec, sort_keys=True)
        with self._storage_lock:
            if key not in self._storages:
                try:
                    self._storages[key] = storage_from_url(
                        request["root"], request.get("storage_options"), request.get("storage_factory")
                    )
                except Exception as exc:
                    raise StorageError(_cannot_open(request, exc)) from exc
            return self._storages[key]

    def slot(self, path: str) -> Slot:
        """The saver's mapping of a slot, kept (pre-faulted) between persists of the same rank.

        Only the rank's own persist thread uses it; it is remapped when the trainer grew or
        recreated the slot.
        """
        slot = self.slots.get(path)
        if slot is not None and (slot.replaced() or slot.file_size() != slot.size):
            slot.close()
            slot = None
        if slot is None:
            slot = Slot.attach(path, populate=True)
            if slot is None:
                raise FileNotFoundError(f"slot {path} does not exist")
            self.slots[path] = slot
        return slot

    def persist(self, request: dict[str, Any], alive: Callable[[], bool] = lambda: True) -> None:
        """Write one rank's files for one step, then its done marker (or failed marker).

        The slot may still be filling (a streaming persist): each region is written once the
        trainer says it is in place, and the rank's files count only once the slot is sealed.
        ``alive()`` says whether the rank is still connected.
        """
        rank, step, seq = int(request["rank"]), int(request["step"]), int(request["seq"])
        layout = Layout(**request["layout"])
        started = time.monotonic()
        slot = self.slot(request["slot"])
        slot.lock()
        try:
            try:
                storage = self.storage(request)
            except Exception:
                slot.mark_persist_done(seq)  # reported to the rank; no later saver retries it
                raise
            try:
                if commit_protocol.already_persisted(storage, layout, request,
                                                     recovered=bool(request.get("recovered"))):
                    return
                _check_directory(storage, request)
                base = commit_protocol.claim(storage, layout, request)
                metadata = _checked_metadata(slot, step, seq, filling=True)
                entries = []

                def ready(index: int) -> None:
                    _wait_until_copied(slot, step, seq, index + 1, alive)
                    fault_point("saver.write")  # part of the file is written

                for fmeta in metadata["files"]:
                    entry = write_file(storage, f"{base}/{fmeta['path']}", fmeta, metadata["regions"], slot, ready)
                    entry["path"] = fmeta["path"]
                    entry["codec"] = fmeta["codec"]
                    entries.append(entry)
                _wait_until_copied(slot, step, seq, None, alive)  # sealed: every byte was in place
                _checked_metadata(slot, step, seq)
                # a saver killed while writing these files left temporaries that would be committed with them
                remove_stale_temporaries(storage, [f"{base}/{e['path']}" for e in entries])
                write_rank_done(storage, layout, request, entries, base)
            except Exception as exc:
                write_rank_failed(storage, layout, request, exc)
                raise
            finally:
                slot.mark_persist_done(seq)
        finally:
            slot.unlock()
            if request.get("held"):  # the trainer's extra slot from before the saver was up: it goes soon
                self.slots.pop(request["slot"], None)
                slot.close()
        total = sum(e["size"] for e in entries)
        elapsed = time.monotonic() - started
        logger.info("rank %d step %d persisted: %d files, %.1f MiB in %.2fs", rank, step, len(entries),
                    total / 2**20, elapsed)

    def commit(self, request: dict[str, Any], local_error: str | None = None,
               answer: Callable[[str | None], Any] = lambda error: None,
               give_way: Callable[[], str | None] = lambda: None) -> bool:
        """Committer (the side of global rank 0): commit once every rank's marker exists
        (:func:`.commit.commit`), answer, then apply retention; whether a commit was written.

        ``answer(error)`` is called once the step is committed (``None``) or failed (the reason),
        before retention; it is called whatever goes wrong, storage that cannot be opened included.
        ``give_way()``: polled while the markers are awaited; a reason it returns ends the wait
        (the step is recorded as failed with it).
        """
        try:
            storage = self.storage(request)
            committed = commit_protocol.commit(storage, request, local_error, give_way=give_way, serial=self._serial)
        except Exception as exc:
            error = f"step {request.get('step')} was not committed: {type(exc).__name__}: {exc}"
            logger.error("%s", error)
            answer(error)
            return False
        answer(None)  # committed, or failed with its FAILED record on storage
        if committed:
            policy = RetentionPolicy(**(request.get("retention") or {}))
            if self._retention is None:
                self.purge(storage, Layout(**request["layout"]), policy)
            else:
                try:
                    self._retention.submit(self._purge_logged, storage, Layout(**request["layout"]), policy)
                except RuntimeError:  # its executor is shut down (closing): the next commit purges
                    pass
        return committed

    def _purge_logged(self, storage: Storage, layout: Layout, policy: RetentionPolicy) -> None:
        try:
            self.purge(storage, layout, policy)
        except Exception as exc:  # retention is best effort: the next commit tries again
            logger.error("retention after the commit failed: %s", exc)

    def purge(self, storage: Storage, layout: Layout, policy: RetentionPolicy) -> None:
        """Delete what the retention policy lets go; a failure is logged and retention goes on."""
        if not policy.enabled:
            return
        with self._serial:
            self._purge(storage, layout, policy)

    def _purge(self, storage: Storage, layout: Layout, policy: RetentionPolicy) -> None:
        records = commit_records(storage)
        self.finish_deletions(storage, records)
        for step in policy.select_deletions(list(records), key=lambda s: lineage.order_key(records[s], s)):
            started = time.monotonic()
            # the step's own directory, as its record names it (a save may have had a folder of its own)
            folder = records[step].get("step_dir") or layout.step_path(step)
            try:
                # The tombstone first: a pass cut short below leaves a step that says it is being deleted.
                write_json(storage, f"{layout.marker_dir(step)}/{DELETING}",
                           {"step": step, "files": folder, "record": records[step], "time": now()})
                storage.remove(f"{layout.marker_dir(step)}/{COMMITTED}")
                fault_point("retention.delete")  # uncommitted, its files not yet deleted
                storage.remove(folder)
                storage.remove(layout.marker_dir(step))
            except Exception as exc:
                logger.error("retention could not delete step %d: %s", step, exc)
                continue
            logger.info("retention deleted step %d in %.2fs", step, time.monotonic() - started)

    def finish_deletions(self, storage: Storage, records: dict[int, dict[str, Any]]) -> None:
        """Finish deleting the steps that a retention pass marked DELETING and did not see through
        (its process was killed): their files and markers would otherwise stay on storage forever.

        A step with a tombstone and no commit record is such a leftover, unlike a save in flight,
        whose done markers look the same. Only steps older than the newest commit (the one this
        pass follows) are touched: every save still in flight is newer than that one, so none of
        them is writing into the directory of the step being finished. A tombstone next to a
        commit record (a kill before that record went, or the step saved and committed again) is
        left alone: the policy decides about a committed step afresh.
        """
        if not records:
            return
        newest = max(records, key=lambda s: lineage.order_key(records[s], s))
        for step in marked_steps(storage):
            if step >= newest or step in records:
                continue
            marker_dir = Layout.marker_dir(step)
            try:
                if DELETING not in storage.list(marker_dir):
                    continue
                tombstone = read_json(storage, f"{marker_dir}/{DELETING}")
                storage.remove(tombstone["files"])
                storage.remove(marker_dir)
            except Exception as exc:
                logger.error("retention could not finish deleting step %d: %s", step, exc)
                continue
            logger.warning("retention finished deleting step %d, which an interrupted pass had left on storage", step)

    def close(self) -> None:
        """Unmap the slots persists mapped."""
        for slot in self.slots.values():
            slot.close()
        self.slots.clear()


def _cannot_open(request: dict[str, Any], exc: BaseException) -> str:
    """Why the saver could not open a request's storage, and what to do about it."""
    factory, root = request.get("storage_factory"), request["root"]
    scheme = root.split("://", 1)[0] if "://" in root else ""
    said = f"the saver could not open the storage {root!r}: {type(exc).__name__}: {exc}"
    if factory:
        return (f"{said}. The saver is a separate process: storage_factory {factory!r} must be importable in "
                "the saver, which runs with cwd=/, the trainer's environment and the training script's folder "
                "on its PYTHONPATH: put the factory in an installed package, beside the script, or on PYTHONPATH")
    if scheme not in ("", "file"):
        return (f"{said}. The saver is a separate process: a scheme registered with register_storage() exists "
                f"only in the process that registered it; declare it through the {ENTRY_POINT_GROUP!r} entry "
                "point group, or pass storage_factory='package.module:factory'")
    return said


def _check_directory(storage: Storage, request: dict[str, Any]) -> None:
    """Refuse to persist a snapshot into a directory that was deleted or replaced since it was taken."""
    expected = (request.get("tag") or {}).get("dir")
    if expected is None:
        return
    found = lineage.read_identity(storage)
    if found != expected:
        raise RuntimeError(
            f"the checkpoint directory {request['root']} was deleted or replaced after step {request['step']} "
            f"was snapshotted (identity {expected}, now {found}); this snapshot belongs to the old directory "
            "and is not written into the new one"
        )


def _checked_metadata(slot: Slot, step: int, seq: int, *, filling: bool = False) -> dict[str, Any]:
    """The slot's metadata, checked to be this step's; ``filling`` also accepts a slot being written."""
    header = slot.read_header()
    states = (SlotState.COMPLETE, SlotState.WRITING) if filling else (SlotState.COMPLETE,)
    if header is None or header.state not in states or header.seq != seq or header.step != step:
        raise RuntimeError(
            f"slot {slot.path} no longer holds step {step} (seq {seq}): found "
            f"{header and (header.state.name, header.step, header.seq)}"
        )
    return slot.read_metadata(header)


def _wait_until_copied(slot: Slot, step: int, seq: int, regions: int | None, alive: Callable[[], bool]) -> None:
    """Wait until the first ``regions`` regions are in place (``None``: until the slot is sealed)."""
    delay = 0.0002
    while True:
        header = slot.read_header()
        if header is None or header.seq != seq or header.step != step or header.state is SlotState.EMPTY:
            raise RuntimeError(f"the snapshot of step {step} was abandoned while it was being written")
        if header.state is SlotState.COMPLETE or (regions is not None and slot.copied() >= regions):
            return
        if not alive():
            raise RuntimeError(f"the rank disconnected while its snapshot of step {step} was being written")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
