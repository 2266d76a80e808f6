"""The load path of :class:`~flashckpt_integrations.Checkpointer`: what an attempt may load, how it
decides how it starts, and loading from memory or storage.

Call order (every rank, collectively where said): before anything else an attempt's queries
(``memory_steps()``, ``committed_steps()``) see the provisional view of :mod:`.lineage`; then
once, collectively, the attempt decides: ``load()`` (continues the lineage of what it loads, or
starts a new one), ``start_attempt(step | None)`` (code that resumed through another loader), or
the first ``save()`` (a fresh start); from then on every query and load sees that attempt's view.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from .._utils import devices
from .._utils.locks import lock_held
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, LayoutMismatchError
from . import collectives, lineage
from .codecs import decode_from_slot, read_file
from .layout import commit_record, commit_records, files_dir, read_json
from .restore import copy_into_target, is_files
from .results import LoadResult
from .shm_buffer import Slot, SlotState
from .state import Codec

logger = logging.getLogger(__name__)


class LoadPath:
    """Mixed into ``Checkpointer``: its lineage decisions and its load path (uses its attributes)."""

    def committed_steps(self) -> list[int]:
        """Steps committed on storage by this attempt's lineage (see :mod:`.lineage`), ascending.

        Commits of attempts that this one did not continue (a run restarted from scratch in the
        same directory, a resume from an older checkpoint) are not listed: they are never loaded.
        """
        return sorted(self._commit_records())

    def _commit_records(self) -> dict[int, dict[str, Any]]:
        view = self._lineage_view()
        return {step: record for step, record in commit_records(self.storage).items() if view.accepts(record, step)}

    def start_attempt(self, resumed_step: int | None = None, *, from_memory: bool = False) -> None:
        """Say how this attempt starts (collective, once; ``load()`` and the first ``save()`` say it
        themselves when it was not said before).

        ``None``: from scratch. Snapshots and commits of earlier attempts are then never loaded
        by this attempt or its restarts, and its saves of steps they committed replace them.
        A step: resumed from that committed step (or, ``from_memory``, from this job's memory
        snapshot of it) by other code, e.g. a framework's own loader; this attempt continues the
        lineage that wrote it.
        """
        self._check_open()
        if self._decided:
            return
        if resumed_step is None:
            self._begin(None, None)
            return
        if from_memory:  # rank 0's tag names the lineage; every rank holds the step (the caller checked)
            snapshot = self._memory_snapshots().get(resumed_step)
            parent = (snapshot[1].get("tag") if snapshot is not None else None) or {}
        else:  # every rank reads the same record
            parent = self._any_record(resumed_step, self._commit_records())
            if parent is None:
                raise CheckpointNotFoundError(
                    f"step {resumed_step} is not committed in {self.url}; committed: {self.committed_steps()}")
        self._begin(parent, resumed_step)

    def _begin(self, parent: Mapping[str, Any] | None, fork_step: int | None, *, by_save: bool = False) -> None:
        """Record this attempt's lineage (rank 0) and share its view with every rank.

        ``by_save``: the first save opens the attempt; its record is written while that save
        copies (the save seals its slot only once the record is on storage)."""
        if self._world_agrees():
            view = None
            if self.rank == 0:
                view, record = lineage.begin(self.storage, parent, fork_step, record_fresh=not by_save)
                self._unpublished = record if parent is not None or by_save else None
            view_dict = collectives.all_gather_object(view.to_dict() if view is not None else None,
                                                      self.world_size, self.process_group)[0]
            view = lineage.View.from_dict(view_dict)
        else:  # ranks without a process group cannot agree on a new lineage: they continue the newest
            current = lineage.provisional_view(self.storage)
            view = lineage.View(lineage.ensure_identity(self.storage), current.caps[0][0], current.caps)
        self._view, self._decided = view, True
        logger.debug("[RANK %d] attempt lineage %s (resumed %s at %s)", self.rank, view.lineage,
                     parent and parent.get("lineage"), fork_step)

    def _publish_attempt(self, record: dict[str, Any]) -> None:
        published = lineage.publish(self.storage, record)
        if published["lineage"] != record["lineage"]:
            logger.error("[RANK %d] another job started attempt %d in %s at the same time; this job's snapshots "
                         "are stamped with it too and may not load after a restart. Give each job its own "
                         "checkpoint directory", self.rank, record["lineage"], self.url)

    def _world_agrees(self) -> bool:
        """Whether the ranks can agree through a collective (a process group, or one rank)."""
        return self.world_size == 1 or collectives._initialized()

    def _lineage_view(self) -> lineage.View:
        """What this attempt may load: decided, or (before it decides) the newest lineage's view."""
        if self._view is None:
            self._view = lineage.provisional_view(self.storage)
        return self._view

    def memory_steps(self) -> list[int]:
        """Steps held complete in this rank's slots, ascending."""
        return sorted(self._memory_snapshots())

    def recover_replicas(self, step: int | None = None) -> int | None:
        """Where a rank's node lost its memory, fetch a step from a peer's replica into its slot.

        Collective (every rank calls it). With peer replicas on: when the newest step a rank holds
        in memory (or ``step``) is not held by every rank, the ranks agree on the newest one that
        every rank holds locally or in a peer's replica, at least as new as the newest commit, and
        the ranks without it copy it into their own slot; afterwards :meth:`memory_steps` lists it
        on every rank. Returns that step, or ``None`` (replicas off, nothing missing, or no common
        step). :meth:`load` does this itself; an adapter that decides the step to resume from on
        its own calls this first.
        """
        if not self._replicas.enabled:
            return None
        self._check_open()
        self.wait_for_snapshot()
        memory = self._memory_snapshots()
        committed = self.committed_steps()
        self._replicas.prepare_load()
        views, in_every_rank = self._agree(memory, committed[-1] if committed else None)
        before = set(in_every_rank)
        _, in_every_rank = self._replicas.resolve(memory, views, in_every_rank, views[0][1], step)
        fetched = in_every_rank - before
        return max(fetched) if fetched else None

    def _agree(self, memory: Mapping[int, Any], newest_commit: int | None) -> tuple[list[Any], set[int]]:
        """Every rank's memory steps and newest commit (collective), and the steps every rank holds."""
        views = collectives.all_gather_object([sorted(memory), newest_commit], self.world_size, self.process_group)
        return views, set.intersection(*(set(v[0]) for v in views)) if views else set()

    def load(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        map_location: Any = None,
        prefer_memory: bool = True,
        weights_only: bool | None = None,
    ) -> LoadResult | None:
        """Load the newest checkpoint (or ``step``); ``None`` when there is none at all.

        Collective when a process group is initialised: every rank must call it. With
        ``target`` (the live state, as passed to ``save``) tensors are copied in place into
        the target's tensors; otherwise fresh tensors are returned.
        """
        self._check_open()
        self.wait_for_snapshot()
        weights_only = self.config.weights_only if weights_only is None else weights_only
        memory = self._memory_snapshots() if prefer_memory else {}
        records = self._commit_records()
        committed = sorted(records)
        if prefer_memory:
            self._replicas.prepare_load()
        views, in_every_rank = self._agree(memory, committed[-1] if committed else None)
        newest_commit = views[0][1]
        if prefer_memory:  # a rank whose node lost its memory may fetch the step from a peer's replica
            memory, in_every_rank = self._replicas.resolve(memory, views, in_every_rank, newest_commit, step)
        if step is None:
            eligible = [s for s in in_every_rank if newest_commit is None or s >= newest_commit]
            chosen_memory = max(eligible) if eligible else None
            step = chosen_memory if chosen_memory is not None else newest_commit
        else:
            chosen_memory = step if step in in_every_rank else None
        if not self._decided:  # this attempt continues the lineage of what it loads, or starts one
            if step is None:
                self._begin(None, None)
            else:
                tag = memory[step][1].get("tag") if chosen_memory is not None else self._any_record(step, records)
                self._begin(tag, step)
        if step is None:
            return None
        started = time.perf_counter()
        locations: dict[int, str] | None = None
        if chosen_memory is not None:
            slot, meta = memory[step]
            keep = map_location
            if target is not None and map_location is None:  # restore straight from the slot (item 9)
                locations = {}
                keep = functools.partial(_keep_on_host, locations)
                # a process holds a CUDA tensor only once CUDA is initialised: skip the walk on a CPU job
                cuda = devices.cuda_index_of(target) if torch.cuda.is_initialized() else None
                if cuda is not None and self.config.pin_memory and slot.needs_pin:
                    slot.pin(cuda)  # a slot re-attached after a restart is not page-locked yet
            files = {
                f["path"]: decode_from_slot(slot, meta["regions"], f, weights_only=weights_only,
                                            map_location=keep, copy=target is None)
                for f in meta["files"]
            }
            source = "memory"
            self._replicas.restored(slot)
        else:
            files = self._load_from_storage(step, weights_only, map_location)
            source = "storage"
        if target is not None:
            files = copy_into_target(files, self._files(target, None) if not is_files(target) else target,
                                     locations)
        logger.info("[RANK %d] loaded step %d from %s in %.3fs", self.rank, step, source,
                    time.perf_counter() - started)
        return LoadResult(step, source, files)

    def read_file(self, step: int, path: str, codec: Codec | str = Codec.TORCH, **kwargs: Any) -> Any:
        """Read any file of committed ``step`` from storage (for loading into another layout)."""
        record = commit_record(self.storage, step)
        if record is None:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.url}")
        base = files_dir(self.storage, self.layout, step, record)
        return read_file(self.storage, f"{base}/{path}", Codec(codec), **kwargs)

    def _any_record(self, step: int, records: Mapping[int, dict[str, Any]]) -> dict[str, Any] | None:
        """The commit record of ``step``: this lineage's, or (an explicit older step) any commit's."""
        return records.get(step) or commit_record(self.storage, step)

    # --- loading internals -----------------------------------------------------------------

    def _memory_snapshots(self) -> dict[int, tuple[Slot, dict[str, Any]]]:
        """Complete, checksum-verified snapshots of this rank, by step (newest seq wins)."""
        self._wait_sealed()  # a first save returned before its seal: it is listed once sealed
        found: dict[int, tuple[int, Slot, dict[str, Any]]] = {}
        for index in range(len(self._slots)):
            try:
                slot = self._slot(index)
                header = slot.read_header() if slot is not None else None
                if header is None or header.state is not SlotState.COMPLETE:
                    continue
                meta = slot.read_metadata(header)
            except CorruptCheckpointError as exc:
                logger.error("[RANK %d] ignoring corrupt snapshot: %s; falling back to storage", self.rank, exc)
                continue
            if meta.get("rank") != self.rank or meta.get("world_size") != self.world_size:
                logger.warning("[RANK %d] snapshot of step %s was taken by rank %s of %s ranks; not used",
                               self.rank, header.step, meta.get("rank"), meta.get("world_size"))
                continue
            if not self._accept_snapshot(slot, header.step, meta):
                continue
            if header.step not in found or found[header.step][0] < header.seq:
                found[header.step] = (header.seq, slot, meta)
        return {step: (slot, meta) for step, (_, slot, meta) in found.items()}

    def _accept_snapshot(self, slot: Slot, step: int, meta: dict[str, Any]) -> bool:
        """Whether a complete snapshot belongs to this attempt's view; one of a deleted or replaced
        directory is discarded (its slot is reused by the next save)."""
        view = self._lineage_view()
        tag = meta.get("tag")
        if view.accepts(tag, step):
            return True
        if view.foreign_directory(tag) or (view.dir_id is None and (tag or {}).get("dir") is not None):
            logger.warning("[RANK %d] the snapshot of step %d in memory belongs to an earlier %s that was deleted or "
                           "replaced since; it is discarded", self.rank, step, self.url)
            if not locked_by_saver(slot):
                slot.invalidate()
        else:
            logger.info("[RANK %d] the snapshot of step %d in memory belongs to an attempt that this one does not "
                        "continue (lineage %s); not used", self.rank, step, (tag or {}).get("lineage", 0))
        return False

    def _load_from_storage(self, step: int, weights_only: bool, map_location: Any) -> dict[str, Any]:
        record = commit_record(self.storage, step)
        if record is None:
            raise CheckpointNotFoundError(
                f"step {step} is not committed in {self.url}; committed steps: {self.committed_steps()}"
            )
        if record["world_size"] != self.world_size:
            raise LayoutMismatchError(
                f"step {step} was saved by {record['world_size']} ranks and this job has {self.world_size}; "
                "read the files you need with Checkpointer.read_file() or use an adapter that reshards"
            )
        marker = read_json(self.storage, self.layout.rank_marker(step, self.rank, sid=record.get("sid", "")))
        base = files_dir(self.storage, self.layout, step, record)
        return {
            entry["path"]: read_file(self.storage, f"{base}/{entry['path']}", Codec(entry["codec"]),
                                     expected=entry, weights_only=weights_only, map_location=map_location)
            for entry in marker["files"]
        }


def _keep_on_host(locations: dict[int, str], storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
    """A ``map_location`` that leaves a storage where it is (a view of the slot) and notes where it was saved."""
    locations[storage.data_ptr()] = location
    return storage


def locked_by_saver(slot: Slot) -> bool:
    """The saver holds an exclusive lock on a slot file while it persists it."""
    return lock_held(slot.path, exclusive_only=True)
