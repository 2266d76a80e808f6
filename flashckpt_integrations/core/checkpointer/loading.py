"""The load path of one rank: what it may load, loading from memory or storage, verified.

Call order (every rank, collectively where said): ``memory_steps()`` / ``committed_steps()`` at
any time (before the attempt decides, they see the provisional view of :mod:`..lineage`); then
``load()`` (collective: the ranks agree on a step, restore it verified, fall back together when a
copy fails, and the attempt continues the lineage of what it loaded) or ``start_attempt(step)``
(code that resumed through another loader). Adapters that read a snapshot their own way choose
it from ``memory_snapshots()``, after ``recover_replicas()`` and before ``check_memory(step)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._utils import devices
from ...config import CheckpointerConfig
from ...errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FlashCkptError,
    LayoutMismatchError,
    StorageError,
)
from .. import collectives, reshard, verify
from ..client import SaverClient
from ..codecs import decode_from_slot, read_file
from ..layout import Layout, commit_record, files_dir, read_json
from ..replication.rank import ReplicaHook
from ..restore import copy_into_target, is_files
from ..results import LoadResult
from ..shm_buffer import Slot, SlotState
from ..state import Codec, FileSpec
from ..storage import Storage
from .attempt import Attempt
from .saving import SavePath, files_of
from .slots import RankSlots, locked_by_saver

logger = logging.getLogger(__name__)


class LoadPath:
    """Loads of one rank (see the module docstring)."""

    def __init__(self, config: CheckpointerConfig, *, rank: int, world_size: int, process_group: Any, url: str,
                 storage: Storage, layout: Layout, slots: RankSlots, attempt: Attempt, saves: SavePath,
                 sums: verify.Checksummer, replicas: ReplicaHook, client: SaverClient,
                 check_open: Callable[[], None]) -> None:
        self.config, self.rank, self.world_size, self.process_group = config, rank, world_size, process_group
        self.url, self.storage, self.layout = url, storage, layout
        self.slots, self.attempt, self.saves, self.sums = slots, attempt, saves, sums
        self.replicas, self.client, self._check_open = replicas, client, check_open
        self._verified: set[tuple[str, int]] = set()  # (slot path, seq) checked whole by check_memory()

    def committed_steps(self) -> list[int]:
        """Steps committed on storage by this attempt's lineage (see :mod:`.lineage`), ascending.

        Commits of attempts that this one did not continue (a run restarted from scratch in the
        same directory, a resume from an older checkpoint) are not listed: they are never loaded.
        """
        return sorted(self.attempt.commit_records())

    def start_attempt(self, resumed_step: int | None = None, *, from_memory: bool = False,
                      tag: Mapping[str, Any] | None = None) -> None:
        """Say how this attempt starts (collective, once; ``load()`` and the first ``save()`` say it
        themselves when it was not said before).

        ``None``: from scratch. Snapshots and commits of earlier attempts are then never loaded
        by this attempt or its restarts, and its saves of steps they committed replace them.
        A step: resumed from that committed step (or, ``from_memory``, from this job's memory
        snapshot of it) by other code, e.g. a framework's own loader; this attempt continues the
        lineage that wrote it. ``tag``: with ``from_memory``, the snapshot's lineage tag when the
        snapshot is not this job's own (one that a job of another number of ranks left, see
        :mod:`..reshard`).
        """
        self._check_open()
        if self.attempt.decided:
            return
        if resumed_step is None:
            self.attempt.begin(None, None)
            return
        if from_memory and tag is not None:
            parent = dict(tag)
        elif from_memory:  # rank 0's tag names the lineage; every rank holds the step (the caller checked)
            snapshot = self.memory_snapshots().get(resumed_step)
            parent = (snapshot[1].get("tag") if snapshot is not None else None) or {}
        else:  # every rank reads the same record
            parent = self.attempt.any_record(resumed_step, self.attempt.commit_records())
            if parent is None:
                raise CheckpointNotFoundError(
                    f"step {resumed_step} is not committed in {self.url}; committed: {self.committed_steps()}")
        self.attempt.begin(parent, resumed_step)

    def memory_steps(self) -> list[int]:
        """Steps held complete in this rank's slots, ascending."""
        return sorted(self.memory_snapshots())

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
        if not self.replicas.enabled:
            return None
        self._check_open()
        self.saves.wait_for_snapshot()
        memory = self.memory_snapshots()
        committed = self.committed_steps()
        self.replicas.prepare_load()
        views, in_every_rank = self._agree(memory, committed[-1] if committed else None)
        before = set(in_every_rank)
        _, in_every_rank = self.replicas.resolve(memory, views, in_every_rank, views[0][1], step)
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
        self.saves.wait_for_snapshot()
        self.sums.wait()
        snapshot = self.memory_snapshots().get(step)
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
                self.client.connect()
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
        self.saves.wait_for_snapshot()
        self.sums.wait()  # this process's own snapshots are verified against tables it is writing
        weights_only = self.config.weights_only if weights_only is None else weights_only
        if prefer_memory:
            self.replicas.prepare_load()
        fallback, started = _Fallback(), time.perf_counter()  # the log gives the whole restore, fallbacks too
        while True:
            choice = self._choose(step, prefer_memory, fallback)
            if prefer_memory and step is None and not choice.memory and not fallback.events:
                self._refuse_to_lose_resharded(choice.step)
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
        memory = self.memory_snapshots() if prefer_memory else {}
        memory = {s: v for s, v in memory.items() if s not in fallback.memory}
        records = {s: r for s, r in self.attempt.commit_records().items() if s not in fallback.commits}
        committed = sorted(records)
        views, in_every_rank = self._agree(memory, committed[-1] if committed else None)
        newest_commit = views[0][1]
        fetched = False
        if prefer_memory:  # a rank whose node lost its memory may fetch the step from a peer's replica
            before = set(memory)
            memory, in_every_rank = self.replicas.resolve(memory, views, in_every_rank, newest_commit, step)
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

    def _refuse_to_lose_resharded(self, chosen: int | None) -> None:
        """Raise (on every rank) when a job of another number of ranks left a newer step in memory
        than ``chosen``: files saved one per rank cannot be resharded, and starting from an older
        step (or from scratch) would silently lose the steps in between."""
        newer = reshard.newest_elsewhere(self)
        if newer is None or (chosen is not None and newer[0] <= chosen):
            return
        raise LayoutMismatchError(
            f"step {newer[0]} is in the memory of this job's nodes, saved by a job of {newer[1]} ranks; this job has "
            f"{self.world_size}. Checkpointer.load restores each rank's own files and cannot spread {newer[1]} "
            f"ranks' state over {self.world_size}: restart with {newer[1]} ranks to resume from it, or save through "
            "the DCP adapter (flashckpt_integrations.adapters.dcp), whose load restores onto another number of ranks "
            "from memory. " + ("load(prefer_memory=False) starts from scratch instead (nothing is committed)"
                               if chosen is None else
                               f"load(prefer_memory=False) loads the newest commit, step {chosen}, instead"))

    def _decide(self, choice: _Choice) -> None:
        """This attempt continues the lineage of what it loaded, or starts one (once)."""
        if self.attempt.decided:
            return
        if choice.step is None:
            self.attempt.begin(None, None)
        else:
            tag = (choice.snapshots[choice.step][1].get("tag") if choice.memory
                   else self.attempt.any_record(choice.step, choice.records))
            self.attempt.begin(tag, choice.step)

    def _restore(self, choice: _Choice, target: Any, map_location: Any, weights_only: bool, *, fused: bool
                 ) -> tuple[Any, str, str, str | None]:
        """Restore ``choice`` on this rank: ``(files, "ok" | "failed" | "fatal", tier, reason)``.

        A failed verification (or an unreadable copy) is ``"failed"``: the ranks fall back. Any other
        error is ``"fatal"``: every rank raises it, none waits on the others. ``fused``: the
        host copies verify as they go (a failure leaves the targets half-written, so only where
        a commit exists to restore over them); otherwise everything is checked before the copy.
        """
        step = choice.step
        tier = ("replica" if choice.fetched and self.replicas.fetched and self.replicas.fetched.get("step") == step
                else "memory") if choice.memory else "storage"
        try:
            if choice.memory:
                slot, meta = choice.snapshots[step]
                files = self._restore_memory(slot, meta, target, map_location, weights_only, fused)
                self.replicas.restored(slot)
            else:
                files = self._restore_storage(step, target, map_location, weights_only,
                                              into_target=fused and len(choice.committed) > 1)
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
        return copy_into_target(files, self._target_files(target), locations,
                                fuse)

    def _target_files(self, target: Any) -> Any:
        """A restore's ``target`` as the files ``save`` named: a ``{path: object}`` map, or the rank's one file."""
        return target if is_files(target) else files_of(self.rank, target, None)

    def committed_folder(self, step: int) -> str | None:
        """Where the files of committed ``step`` are, relative to the checkpoint directory (the
        save's own folder, or the layout's ``step_dir``); None when the step is not committed."""
        record = commit_record(self.storage, step)
        return None if record is None else files_dir(self.storage, self.layout, step, record)

    def snapshot_folder(self, step: int) -> str | None:
        """The folder (relative to the checkpoint directory) that this rank's memory snapshot of ``step``
        was saved for (``save(..., folder=)``, or the layout's ``step_dir``); None when it holds no
        snapshot of ``step``."""
        snapshot = self.memory_snapshots().get(step)
        if snapshot is None:
            return None
        layout = snapshot[1].get("persist_target", {}).get("layout") or {}
        return layout.get("folder") or self.layout.step_path(step)

    def committed_entries(self, step: int) -> dict[str, dict[str, Any]]:
        """Every rank's files of committed ``step`` by path (relative to :meth:`committed_folder`):
        each one's rank-marker entry, with the size and crc32 it was written with."""
        record = commit_record(self.storage, step)
        if record is None:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.url}")
        out: dict[str, dict[str, Any]] = {}
        for rank in range(int(record["world_size"])):
            marker = read_json(self.storage, self.layout.rank_marker(step, rank, sid=record.get("sid", "")))
            out.update((entry["path"], entry) for entry in marker["files"])
        return out

    def read_file(self, step: int, path: str, codec: Codec | str = Codec.TORCH, **kwargs: Any) -> Any:
        """Read any file of committed ``step`` from storage (for loading into another layout)."""
        record = commit_record(self.storage, step)
        if record is None:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.url}")
        base = files_dir(self.storage, self.layout, step, record)
        return read_file(self.storage, f"{base}/{path}", Codec(codec), **kwargs)

    def memory_snapshots(self) -> dict[int, tuple[Slot, dict[str, Any]]]:
        """Complete, checksum-verified snapshots of this rank, by step (newest seq wins)."""
        self.attempt.wait_sealed()  # a first save returned before its seal: it is listed once sealed
        found: dict[int, tuple[int, Slot, dict[str, Any]]] = {}
        for index in self.slots.indices():
            try:
                slot = self.slots.get(index)
                header = slot.read_header() if slot is not None else None
                if header is None or header.state is not SlotState.COMPLETE:
                    continue
                meta = slot.read_metadata(header)
            except CorruptCheckpointError as exc:
                logger.error("[RANK %d] ignoring corrupt snapshot: %s; falling back to storage", self.rank, exc)
                continue
            if meta.get("rank") != self.rank or meta.get("world_size") != self.world_size:
                logger.info("[RANK %d] snapshot of step %s was taken by rank %s of %s ranks; not used",
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
        view = self.attempt.view()
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

    def _restore_storage(self, step: int, target: Any, map_location: Any, weights_only: bool, *,
                         into_target: bool) -> dict[str, Any]:
        """Read committed ``step`` (into ``target``), each file in one pass (:mod:`..reading`).
        ``into_target``: storages land in the target's tensors as they are read, before the
        file's checksum is known (only where an older commit can be restored over them)."""
        if target is None:
            return self._load_from_storage(step, weights_only, map_location)
        targets = self._target_files(target)
        locations: dict[int, str] | None = {} if map_location is None else None
        into = {path: (spec.obj if isinstance(spec, FileSpec) else spec) for path, spec in targets.items()
                } if into_target else {}
        files = self._load_from_storage(step, weights_only, map_location, into, locations)
        return copy_into_target(files, targets, locations)

    def _load_from_storage(self, step: int, weights_only: bool, map_location: Any,
                           into: Mapping[str, Any] | None = None, locations: dict[int, str] | None = None
                           ) -> dict[str, Any]:
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
                                     expected=entry, weights_only=weights_only, map_location=map_location,
                                     target=(into or {}).get(entry["path"]), locations=locations)
            for entry in marker["files"]
        }


def _keep_on_host(locations: dict[int, str], storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
    """A ``map_location`` that leaves a storage where it is (a view of the slot) and notes where it was saved."""
    locations[storage.data_ptr()] = location
    return storage


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

