"""The load path of :class:`~flashckpt_integrations.Checkpointer`: what an attempt may load, how it
decides how it starts, and loading from memory or storage.

Call order (every rank, collectively where said): before anything else an attempt's queries
(``memory_steps()``, ``committed_steps()``) see the provisional view of :mod:`.lineage`; then
once, collectively, the attempt decides: ``load()`` (continues the lineage of what it loads, or
starts a new one), ``start_attempt(step | None)`` (code that resumed through another loader), or
the first ``save()`` (a fresh start); from then on every query and load sees that attempt's view.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._utils import devices
from .._utils.locks import lock_held
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FlashCkptError,
    LayoutMismatchError,
    StorageError,
)
from . import collectives, lineage, verify
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

    def check_memory(self, step: int) -> bool:
        """Verify every rank's memory snapshot of ``step`` against its checksums (collective).

        For adapters that choose the step themselves and then read the snapshot their own way:
        a rank whose copy fails (or has no checksums) invalidates it and says so in a WARNING, and
        every rank gets ``False`` (choose again: :meth:`memory_steps` no longer lists it there).
        A snapshot checked here is not checked again by the next restore in this process.
        """
        self._check_open()
        self.wait_for_snapshot()
        self._sums.wait()
        snapshot = self._memory_snapshots().get(step)
        error = "no snapshot of this step" if snapshot is None else None
        if snapshot is not None:
            slot, meta = snapshot
            try:
                header = slot.read_header()
                check = self._open_check(slot, header, meta)
                check.check()
                self._verified.add((slot.path, header.seq))
            except CorruptCheckpointError as exc:
                error = str(exc)
                logger.warning("[RANK %d] the snapshot of step %d in memory failed verification and is discarded: "
                               "%s", self.rank, step, exc)
                slot.invalidate()
        errors = collectives.all_gather_object(error, self.world_size, self.process_group)
        return not any(errors)

    def _open_check(self, slot: Slot, header: Any, meta: dict[str, Any]) -> verify.SnapshotCheck:
        """The snapshot's checksums; where they are missing (this rank's last process was killed
        right after the seal), first wait for the node's saver, which sums what a dead rank left
        behind before it answers a new rank."""
        try:
            return verify.open_check(slot, header, meta)
        except verify.UnverifiedSnapshotError:
            try:
                self._client.connect()
            except FlashCkptError as exc:
                logger.debug("[RANK %d] no saver to sum step %d: %s", self.rank, header.step, exc)
            return verify.open_check(slot, header, meta)

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

        Every byte is verified against the checksum taken when it was saved (a memory snapshot's
        table, see :mod:`.verify`; a committed file's crc32) before training can see it. When a
        rank's copy fails, every rank falls back together to the newest step that all of them can
        serve verified (another snapshot in memory, a peer's replica, storage, then nothing), with
        one WARNING per fallback; the bad snapshot is invalidated so no restart takes it again.
        ``LoadResult.tiers`` says which tier served each rank.
        """
        self._check_open()
        self.wait_for_snapshot()
        self._sums.wait()  # this process's own snapshots are verified against tables it is writing
        weights_only = self.config.weights_only if weights_only is None else weights_only
        if prefer_memory:
            self._replicas.prepare_load()
        fallback, started = _Fallback(), time.perf_counter()  # the log gives the whole restore, fallbacks too
        while True:
            choice = self._choose(step, prefer_memory, fallback)
            if choice.step is None:
                self._decide(choice)
                if fallback.events:
                    logger.warning("[RANK %d] no verified checkpoint is left after %s; starting from scratch",
                                   self.rank, "; ".join(fallback.events))
                return None
            outcome = self._restore(choice, target, map_location, weights_only, fused=bool(choice.committed))
            outcomes = collectives.all_gather_object(outcome[1:], self.world_size, self.process_group)
            if all(o[0] == "ok" for o in outcomes):
                break
            fallback.failed(self, choice, outcome[0], outcomes, explicit=step is not None)
        self._decide(choice)
        files, source = outcome[0], outcomes[self.rank][1]
        logger.info("[RANK %d] loaded step %d from %s in %.3fs", self.rank, choice.step, source,
                    time.perf_counter() - started)
        return LoadResult(choice.step, "memory" if choice.memory else "storage", files,
                          tiers={rank: o[1] for rank, o in enumerate(outcomes)}, fallbacks=list(fallback.events))

    def _choose(self, step: int | None, prefer_memory: bool, fallback: _Fallback) -> _Choice:
        """The step every rank restores next (collective): the newest one every rank holds in
        memory (its own slot or a peer's replica) at least as new as the newest commit, else the
        newest commit; steps that failed verification are left out."""
        memory = self._memory_snapshots() if prefer_memory else {}
        memory = {s: v for s, v in memory.items() if s not in fallback.memory}
        records = {s: r for s, r in self._commit_records().items() if s not in fallback.commits}
        committed = sorted(records)
        views, in_every_rank = self._agree(memory, committed[-1] if committed else None)
        newest_commit = views[0][1]
        fetched = False
        if prefer_memory:  # a rank whose node lost its memory may fetch the step from a peer's replica
            before = set(memory)
            memory, in_every_rank = self._replicas.resolve(memory, views, in_every_rank, newest_commit, step)
            memory = {s: v for s, v in memory.items() if s not in fallback.memory}
            in_every_rank -= fallback.memory
            fetched = bool(set(memory) - before)
        if step is None:
            eligible = [s for s in in_every_rank if newest_commit is None or s >= newest_commit]
            chosen_memory = max(eligible) if eligible else None
            chosen = chosen_memory if chosen_memory is not None else newest_commit
        else:
            chosen = step
            chosen_memory = step if step in in_every_rank else None
        return _Choice(chosen, chosen_memory is not None, memory, records, committed, fetched)

    def _decide(self, choice: _Choice) -> None:
        """This attempt continues the lineage of what it loaded, or starts one (once)."""
        if self._decided:
            return
        if choice.step is None:
            self._begin(None, None)
        else:
            tag = (choice.snapshots[choice.step][1].get("tag") if choice.memory
                   else self._any_record(choice.step, choice.records))
            self._begin(tag, choice.step)

    def _restore(self, choice: _Choice, target: Any, map_location: Any, weights_only: bool, *, fused: bool
                 ) -> tuple[Any, str, str, str | None]:
        """Restore ``choice`` on this rank: ``(files, "ok" | "failed" | "fatal", tier, reason)``.

        A failed verification (or an unreadable copy) is ``"failed"``: the ranks fall back. Any other
        error is ``"fatal"``: every rank raises it, none waits on the others. ``fused``: the
        host copies verify as they go (a failure leaves the targets half-written, so only where
        a commit exists to restore over them); otherwise everything is checked before the copy.
        """
        step = choice.step
        tier = ("replica" if choice.fetched and self._replicas.fetched and self._replicas.fetched.get("step") == step
                else "memory") if choice.memory else "storage"
        try:
            if choice.memory:
                slot, meta = choice.snapshots[step]
                files = self._restore_memory(slot, meta, target, map_location, weights_only, fused)
                self._replicas.restored(slot)
            else:
                files = self._load_from_storage(step, weights_only, map_location)
                if target is not None:
                    files = copy_into_target(files, self._files(target, None) if not is_files(target) else target)
        except (CorruptCheckpointError, OSError, StorageError) as exc:
            return None, "failed", tier, f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            if self.world_size == 1:
                raise
            return exc, "fatal", tier, f"{type(exc).__name__}: {exc}"
        return files, "ok", tier, None

    def _restore_memory(self, slot: Slot, meta: dict[str, Any], target: Any, map_location: Any,
                        weights_only: bool, fused: bool) -> dict[str, Any]:
        """Decode a snapshot from its slot (into ``target``), verified against its checksum table."""
        header = slot.read_header()
        if header is None or header.state is not SlotState.COMPLETE:
            raise CorruptCheckpointError(f"slot {slot.path} changed while it was being restored")
        check = self._open_check(slot, header, meta)
        fuse = None
        if (slot.path, header.seq) not in self._verified:  # (check_memory() has just checked all of it)
            if target is None or not fused:
                check.check()
            else:
                check.check(check.blobs())  # before anything is unpickled
                base = slot.buffer.data_ptr()

                def fuse(pairs: list[Any]) -> list[Any]:
                    copies, rest = check.fuse(pairs, base)
                    check.check(rest)
                    return copies
        keep, locations = map_location, None
        if target is not None and map_location is None:  # restore straight from the slot
            locations = {}
            keep = functools.partial(_keep_on_host, locations)
            # a process holds a CUDA tensor only once CUDA is initialised: skip the walk on a CPU job
            cuda = devices.cuda_index_of(target) if torch.cuda.is_initialized() else None
            if cuda is not None and self.config.pin_memory and slot.needs_pin:
                slot.pin(cuda)  # a slot re-attached after a restart is not page-locked yet
        files = {f["path"]: decode_from_slot(slot, meta["regions"], f, weights_only=weights_only,
                                             map_location=keep, copy=target is None)
                 for f in meta["files"]}
        if target is None:
            return files
        return copy_into_target(files, self._files(target, None) if not is_files(target) else target, locations,
                                fuse)

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


@dataclass
class _Choice:
    """What the ranks agreed to restore: a step, from memory or storage, and what they saw."""

    step: int | None
    memory: bool
    snapshots: dict[int, tuple[Slot, dict[str, Any]]]
    records: dict[int, dict[str, Any]]
    committed: list[int]
    fetched: bool


@dataclass
class _Fallback:
    """The steps one ``load()`` left out after a failed verification, and what it logged."""

    memory: set[int] = field(default_factory=set)
    commits: set[int] = field(default_factory=set)
    tries: Counter = field(default_factory=Counter)
    events: list[str] = field(default_factory=list)

    def failed(self, ck: Any, choice: _Choice, files: Any, outcomes: list[Any], *, explicit: bool) -> None:
        """Every rank, after a restore some rank failed: invalidate this rank's bad copy, leave
        the step's tier out (a memory step after its second failure: its first may be followed
        by a fetch from a peer's replica), or raise what cannot fall back."""
        step, rank = choice.step, ck.rank
        fatal = [(r, o) for r, o in enumerate(outcomes) if o[0] == "fatal"]
        if fatal:
            if isinstance(files, Exception):
                raise files  # this rank's own error, as it was raised
            raise FlashCkptError(f"restoring step {step} failed on another rank: " +
                                 "; ".join(f"rank {r}: {o[2]}" for r, o in fatal))
        failures = [(r, o) for r, o in enumerate(outcomes) if o[0] == "failed"]
        what = "; ".join(f"rank {r} ({o[1]}): {o[2]}" for r, o in failures)
        if outcomes[rank][0] == "failed":
            logger.warning("[RANK %d] step %d from %s failed verification: %s; every rank falls back",
                           rank, step, outcomes[rank][1], outcomes[rank][2])
        elif rank == 0:
            logger.warning("[RANK 0] step %d could not be restored verified on every rank (%s); every rank "
                           "falls back", step, what)
        self.events.append(f"step {step}: {what}")
        if choice.memory:
            if outcomes[rank][0] == "failed":
                slot = choice.snapshots[step][0]
                with contextlib.suppress(Exception):
                    slot.invalidate()  # never taken again, by this load or a restart
            self.tries[step] += 1
            if self.tries[step] >= 2 or not any(o[1] == "memory" for _, o in failures):
                self.memory.add(step)
            return
        self.commits.add(step)
        if explicit or not [s for s in choice.committed if s not in self.commits]:
            raise CorruptCheckpointError(
                f"committed step {step} in {ck.url} failed verification and no older verified checkpoint is "
                f"left: {what}. Restore the file from a backup, or delete the step to start over")

