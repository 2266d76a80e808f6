"""The save path of one rank: plan, copy into a slot, seal, hand to the saver and the peers.

Call order, from ``Checkpointer.save``: ``SavePath.save(step, specs, ...)`` (on the caller's
thread: the plan, the slot, the metadata; the copy too unless the save overlaps training) ->
``complete(pending)`` (the copy: on the caller's thread, or on the copy thread for an overlapped
save) -> ``seal(pending)`` (at once, or on the attempt's writer right after a first save's
record) -> the persist request and the peers' offer, off the training path. Before the state
changes again: ``wait_for_snapshot()`` (the optimizer's pre-hook calls it).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..._utils import devices
from ..._utils.devices import on_device
from ..._utils.faults import after_region, fault_point
from ...config import CheckpointerConfig
from ...errors import SharedMemoryError
from .. import verify
from ..layout import Layout
from ..replication.rank import ReplicaHook
from ..results import SaveResult, SaveStatus
from ..shm_buffer import HEADER_SIZE, Slot
from ..state import FileSpec, PickleCache, SnapshotPlan, copy_regions, plan_snapshot
from . import direct
from .attempt import Attempt
from .requests import PersistRequests
from .slots import RankSlots

logger = logging.getLogger(__name__)

STATE_FILE = "rank-{rank}.pt"
"""File name that ``save(step, state)`` uses for the rank's state inside the step directory."""


def files_of(rank: int, state: Any, files: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The files a save (or a restore's target) names: ``files``, or ``state`` as the rank's one file."""
    if (state is None) == (files is None):
        raise ValueError("pass exactly one of `state` (one object) or `files` ({path: object})")
    return files if files is not None else {STATE_FILE.format(rank=rank): FileSpec(state)}


@dataclass
class PendingSave:
    """One save between its slot's choice and its seal."""

    index: int
    slot: Slot
    plan: SnapshotPlan
    step: int
    seq: int
    sid: str
    request: dict[str, Any] | None  # what the saver is asked to persist (None: memory only)
    meta_offset: int
    raw_meta: bytes
    durable: Future | None  # the saver's answer, for a persisting save
    front: CopyFront | None  # how far the first copy into a new slot got (its pages faulted from the end)
    stream: bool = False  # handed to the saver before the copy: it streams each region once in place


class SavePath:
    """Saves of one rank (see the module docstring)."""

    def __init__(self, config: CheckpointerConfig, *, rank: int, world_size: int, job_key: str,
                 writer: dict[str, Any], slots: RankSlots, requests: PersistRequests, attempt: Attempt,
                 sums: verify.Checksummer, replicas: ReplicaHook) -> None:
        self.config, self.rank, self.world_size, self.job_key, self.writer = config, rank, world_size, job_key, writer
        self.slots, self.requests, self.attempt, self.sums, self.replicas = slots, requests, attempt, sums, replicas
        self.pickles = PickleCache()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-copy")
        self._snapshot: Future | None = None  # an overlapped copy in flight
        self._snapshot_copy: devices.DeviceCopy | None = None
        self.hooks: list[Any] = []
        self._warned_unwaited = False

    # --- waiting for the copy --------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for an overlapped snapshot still being copied."""
        self.hooks.append(optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step()))

    def _before_optimizer_step(self) -> None:
        snapshot, copy = self._snapshot, self._snapshot_copy
        if snapshot is None or snapshot.done() or copy is None:
            self.wait_copy()  # not for a seal still waiting on the attempt's record: the copy is done
            return
        copy.issued.wait()
        if not devices.wait_on_current_streams(copy):
            self.wait_copy()

    def wait_for_snapshot(self) -> str | None:
        """Block until an overlapped copy and a first save's seal are done; the failure or None."""
        error = self.wait_copy()
        return self.attempt.wait_sealed() or error

    def wait_copy(self) -> str | None:
        snapshot = self._snapshot
        if snapshot is None:
            return None
        error = snapshot.result()
        if self._snapshot is snapshot:
            self._snapshot = None
            self._snapshot_copy = None
        return error

    def settle(self) -> None:
        """Wait for an overlapped copy and a pending seal, leaving their outcome to be reported
        (helper threads: the caller's :meth:`wait_for_snapshot` still returns a failure)."""
        for pending in (self._snapshot, self.attempt.sealing):
            if pending is not None:
                pending.result()

    # --- a save ----------------------------------------------------------------------------------

    def prepare(self, specs: Mapping[str, FileSpec] | None, nbytes: int | None, background: bool) -> None:
        """Create and pre-fault every slot ahead of the first save (see ``Checkpointer.prepare``)."""
        device: int | None = None
        if nbytes is None:
            # the first save's plan comes from here: its pickles are made and their values located
            # now, so that save pays what a later one does (about 7 us per tensor) beside its copy
            plan = plan_snapshot(specs, self.pickles)
            self.pickles.locate()
            devices.check_plan(plan)
            nbytes = plan.layout(HEADER_SIZE) + 64 * 1024 + 256 * len(plan.regions)
            device = devices.device_index(plan)
        if background:
            for index in range(self.slots.count):
                self.slots.helper.submit(self.slots.prepare, index, nbytes, device, self.settle)
            return
        with self.slots.lock:  # never remap a slot under an overlapped copy (or a save) into it
            self.wait_for_snapshot()
            self.slots.create_together(range(self.slots.count), nbytes)
            for index in range(self.slots.count):
                if self.slots.persisting_done(index):
                    self.slots.ensure(index, nbytes, pin=device, wait_pin=True)
        self.requests.wait_mapped([self.slots.path(index) for index in range(self.slots.count)])

    def save(self, step: int, specs: Mapping[str, FileSpec], persist: bool, overlap: bool,
             metadata: Mapping[str, Any] | None, folder: str | None = None) -> SaveResult:
        """Snapshot ``specs`` for ``step`` into a slot (see ``Checkpointer.save``)."""
        layout = self.requests.layout.for_folder(folder)
        if not self.attempt.decided:  # neither load() nor start_attempt(): this attempt starts from scratch
            self.attempt.begin(None, None, by_save=True)
        self.attempt.record_first_save()  # rank 0: beside its copy (sealed only once it is written)
        with self.slots.lock:
            self.wait_for_snapshot()
            plan = plan_snapshot(specs, self.pickles)
            devices.check_plan(plan)  # before any slot is touched
            if overlap:
                self._warn_if_unwaited()
            extents = len(plan.regions) + len(plan.files)  # the checksum table sits before the metadata
            table, end = verify.place(plan.layout(HEADER_SIZE), extents)
            tag = self.attempt.view().tag()
            meta = self._metadata(step, plan, tag, metadata, verify.describe(table, extents), layout)
            index, reason = self.slots.choose(hold=end if persist else 0)
            if index is None:
                return SaveResult(step, SaveStatus.SKIPPED, reason)
            seq = self.slots.next_seq()
            sid = self.requests.save_id(step, self.attempt.view()) if persist else ""
            if persist:  # in the slot too: a saver persists it even if this process dies before asking
                meta["persist"] = self.requests.describe(step, seq, self.slots.path(index), sid, tag, layout)
            raw_meta = json.dumps(meta, separators=(",", ":")).encode()
            try:
                pending = self._take_slot(index, plan, step, seq, sid, meta.get("persist"), end, raw_meta)
            except SharedMemoryError as exc:
                self.attempt.wait_recorded()
                return direct.fallback(step, plan, meta, persist, exc, rank=self.rank, storage=self.requests.storage,
                                       layout=layout, retention=self.slots.helper,
                                       poll_commit=self.requests.commit_poller(sid))
            return self._start_copy(pending, persist, overlap)

    def _metadata(self, step: int, plan: SnapshotPlan, tag: dict[str, Any], user: Mapping[str, Any] | None,
                  checksums: dict[str, Any], layout: Layout) -> dict[str, Any]:
        return {
            "format": 1, "step": step, "rank": self.rank, "world_size": self.world_size,
            "job": self.job_key, "time": time.time(), "user": dict(user or {}), **plan.metadata(),
            "persist_target": self.requests.target(layout),  # lets a launcher or the CLI persist it later
            "tag": tag, "checksums": checksums, "writer": self.writer,
        }

    def _take_slot(self, index: int, plan: SnapshotPlan, step: int, seq: int, sid: str,
                   request: dict[str, Any] | None, end: int, raw_meta: bytes) -> PendingSave:
        """Map (create, grow) the chosen slot and start writing into it; prepare the others."""
        pin = devices.device_index(plan)
        nbytes = end + len(raw_meta)
        front = CopyFront(plan) if pin is None and self.slots.get(index) is None else None
        self.sums.release(self.slots.mapped(index))  # a checksum of this slot's last snapshot stops
        # a new slot for a host copy is not pre-faulted here: the helper below faults it in
        slot = self.slots.ensure(index, nbytes, pin=pin, populate=front is None)
        if self.slots.is_held(index):
            self.slots.record_paths()  # a saver that starts after a crash persists the held slot too
        if front is not None:  # from its end, while the copy writes from its start (queued first)
            self.slots.helper.submit(slot.fault_in_from_end, front.offset)
        for other in range(self.slots.count):  # the other slot is created off the training path, sized
            # for this state as this one was (its headroom is added once, by the slot, not twice)
            if other != index and self.slots.mapped(other) is None:
                self.slots.helper.submit(self.slots.prepare, other, nbytes, pin, self.settle)
        persist = request is not None
        if persist and not self.requests.client.connected and self.slots.held_missing():
            # the saver is not up yet: should the next save find every slot waiting for it, the
            # held slot is ready (made off the training path, where /dev/shm has room for it)
            self.slots.helper.submit(self.slots.prepare_held, nbytes, pin, self.settle)
        slot.begin_write(step, seq)
        if persist:
            slot.mark_persist_requested(seq)
        for offset, blob in plan.blobs():
            slot.write_blob(offset, blob)
        durable: Future | None = Future() if persist else None
        stream = self.config.stream_persist and persist and not on_device(plan)
        return PendingSave(index, slot, plan, step, seq, sid, request, end, raw_meta, durable, front, stream)

    def _start_copy(self, pending: PendingSave, persist: bool, overlap: bool) -> SaveResult:
        status = SaveStatus.PERSISTING if persist else SaveStatus.IN_MEMORY
        result = SaveResult(pending.step, status, durable=pending.durable,
                            poll_commit=self.requests.commit_poller(pending.sid))
        copy = devices.begin_copy(pending.plan)  # side streams ordered after the work queued so far
        if overlap:
            self._snapshot_copy = copy
            self._snapshot = self._copier.submit(self._complete_overlapped, result, pending, copy)
            result.sealed = self._snapshot
        else:
            error = self.complete(pending, copy, result=result)
            if error is not None:
                result.status, result.reason = SaveStatus.FAILED, error
            result.sealed = self.attempt.sealing
        return result

    def _complete_overlapped(self, result: SaveResult, pending: PendingSave, copy: Any) -> str | None:
        """The copy of an overlapped save; a failure turns its result FAILED (with the reason)."""
        error = self.complete(pending, copy)
        if error is not None:
            result.status, result.reason = SaveStatus.FAILED, error
        return error

    def _warn_if_unwaited(self) -> None:
        if self.hooks or self._warned_unwaited:
            return
        self._warned_unwaited = True
        logger.warning(
            "[RANK %d] an overlapped save (async_snapshot) with no optimizer attached: nothing waits for the "
            "copy before the state changes, so the snapshot may hold values of a later step (on a GPU it "
            "will). Pass optimizers=[...] to the Checkpointer or call attach_optimizer(), or call "
            "wait_for_snapshot() before changing the state. (Said once per Checkpointer.)", self.rank)

    def complete(self, p: PendingSave, copy: devices.DeviceCopy | None, result: SaveResult | None = None
                 ) -> str | None:
        """Copy the tensors, seal the slot, hand it to the saver. Returns an error or None.

        With ``stream_persist``, a host-memory snapshot that is to be persisted is handed to the
        saver before the copy starts: the saver streams each region as soon as it is in place.
        A save made on the caller's thread (``result``) whose attempt record is still being
        written returns once copied; the record's writer seals it afterwards (:meth:`seal`),
        and whatever reads or reuses the slots waits for that first (``Attempt.wait_sealed``).
        """
        try:
            p.slot.write_metadata(p.step, p.seq, p.meta_offset, p.raw_meta)
            if p.stream:
                self.slots.mark_persisting(p.index, p.durable)
                self.requests.submit(p.slot, p.request, p.durable)
            on_copied = _both(p.slot.publish_copied if p.stream else None,
                              p.front.copied if p.front is not None else None)
            with devices.on_side_streams(copy):  # device copies go to each device's side stream
                try:
                    copy_regions(p.plan, p.slot.buffer, after_region(on_copied), targets=p.slot.copy_targets)
                finally:
                    if p.front is not None:
                        p.front.finish()
            devices.finish_copy(copy)  # sleeps on the done events (no spinning, no device-wide sync)
        except Exception as exc:
            devices.drain(copy)  # copies already issued land before the slot can be reused
            return self._failed(p, exc)
        recording = self.attempt.take_recording()
        if result is not None and not p.stream and recording is not None and not recording.done():
            # on the record's writer, right after the record (an interpreter that exits meanwhile
            # still runs it); the next save waits for it, so its persist request is queued first
            self.attempt.seal_after(self._seal_after, result, recording, p)
            return None
        return self.seal(recording, p)

    def _seal_after(self, result: SaveResult, recording: Future, p: PendingSave) -> str | None:
        """Seal a first save once its attempt's record is on storage; a failure turns it FAILED."""
        error = self.seal(recording, p)
        if error is not None:
            result.status, result.reason = SaveStatus.FAILED, error
        return error

    def seal(self, recording: Future | None, p: PendingSave) -> str | None:
        """Seal a copied slot once the attempt's record (``recording``) is on storage: a snapshot
        is usable only then, else a restart could not tell which attempt took it. Then hand it
        to the saver and peers."""
        try:
            if recording is not None:
                recording.result()
            p.slot.seal()
            fault_point("trainer.sealed")  # sealed, the saver not yet asked
        except Exception as exc:
            return self._failed(p, exc)
        # The data's checksums, on a helper thread (see verify); then the peers copy it in the
        # background (a held slot lives only until its persist: never replicated).
        offer = (None if self.slots.is_held(p.index)
                 else functools.partial(self.replicas.sealed, p.slot.path, p.step, p.seq))
        self.sums.schedule(p.slot, p.seq, offer)
        if p.durable is not None and not p.stream:
            self.slots.mark_persisting(p.index, p.durable)
            self.requests.submit(p.slot, p.request, p.durable)
        return None

    def _failed(self, p: PendingSave, exc: Exception) -> str:
        p.slot.invalidate()  # a streaming persist sees this and fails, never publishing the step
        error = f"snapshot of step {p.step} failed: {type(exc).__name__}: {exc}"
        logger.error("[RANK %d] %s", self.rank, error)
        if p.durable is not None and not p.stream:
            p.durable.set_result({"ok": False, "error": error})
        return error

    def close(self) -> None:
        """Remove the optimizer hooks; let an overlapped copy finish."""
        for hook in self.hooks:
            hook.remove()
        self._copier.shutdown(wait=True)


class CopyFront:
    """How far the first copy into a new slot has got, for the helper that faults its pages in
    from the other end (:meth:`Slot.fault_in_from_end`)."""

    def __init__(self, plan: Any) -> None:
        self._regions = plan.regions
        self._offset = 0

    def copied(self, regions: int) -> None:
        region = self._regions[regions - 1]
        self._offset = region.offset + region.nbytes

    def finish(self) -> None:
        self._offset = 1 << 62  # past any slot's end: the helper stops

    def offset(self) -> int:
        return self._offset


def _both(first: Callable[[int], None] | None, second: Callable[[int], None] | None) -> Any:
    """One per-region callback that calls both (either may be None)."""
    if first is None or second is None:
        return first or second

    def both(regions: int) -> None:
        first(regions)
        second(regions)

    return both
