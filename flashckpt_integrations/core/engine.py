"""The checkpointer: the API every adapter (and plain PyTorch/DDP code) calls.

Call order: ``Checkpointer(dir)`` -> optionally ``prepare(state)`` -> ``save(step, state)``
each time a checkpoint is due -> ``load()`` after a (re)start -> ``wait()`` where the caller
needs durability -> ``close()`` at the end of the job (or ``with Checkpointer(...)``).

``save`` copies the state into one of the rank's two shared-memory slots and, when asked to
persist, tells the node's saver, which writes the files and takes part in the commit. ``load``
restores from memory when every rank holds the same complete snapshot that is at least as new
as the newest commit (decided collectively), otherwise from the newest commit on storage; the
load path and the attempt's lineage decisions live in :mod:`.loading`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from .. import knobs
from .._utils import devices
from .._utils.devices import on_device
from .._utils.faults import after_region, fault_point
from ..config import BusyPolicy, CheckpointerConfig
from ..errors import (
    CorruptCheckpointError,
    FlashCkptError,
    SaverProcessError,
    SharedMemoryError,
)
from . import collectives, direct, lineage, replica_restore, verify
from . import commit as commit_protocol
from .client import SaverClient, job_id_for, job_key, private_dir, run_dir_for
from .layout import Layout, read_json
from .loading import LoadPath, locked_by_saver
from .protocol import SLOTS_FILE
from .results import PersistResult, SaveResult, SaveStatus
from .shm_buffer import HEADER_SIZE, Slot, SlotState
from .state import FileSpec, PickleCache, copy_regions, normalize_files, plan_snapshot
from .storage import storage_from_url

logger = logging.getLogger(__name__)

STATE_FILE = "rank-{rank}.pt"
"""File name that ``save(step, state)`` uses for the rank's state inside the step directory."""
ERROR_EXIT_WAIT_S = 5.0
"""How long a process that exits on an error (a peer lost mid-collective, say) waits for its
in-flight persists: the node's saver finishes them without it, and a commit that needs a lost
node's ranks may never come, so an unbounded wait would keep the launcher from relaunching."""
_EXITING = threading.Event()
"""Set when the interpreter starts to exit: before it joins the request thread, so before any
atexit hook (``threading._register_atexit``, the hook ``concurrent.futures`` uses itself)."""
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_EXITING.set)


class Checkpointer(LoadPath):
    """Flash checkpoints for one rank. Create one per process, on every rank."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        config: CheckpointerConfig | None = None,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        **overrides: Any,
    ) -> None:
        config = config or CheckpointerConfig()
        self.config = replace(config, **overrides) if overrides else config
        self.process_group = process_group
        self.rank, self.world_size = collectives.rank_and_world(rank, world_size, process_group)
        url = os.fspath(checkpoint_dir)
        self.url = url if "://" in url else os.path.abspath(os.path.expanduser(url))
        self.storage = storage_from_url(self.url, self.config.storage_options, self.config.storage_factory)
        self.layout: Layout = self.config.layout
        job = job_id_for(self.url, self.config.job_id)
        self.job_key = job_key(job)
        node = self.config.node_id or knobs.get(knobs.NODE_ID) or (
            f"{socket.gethostname()}-{os.environ.get('GROUP_RANK', '0')}"
        )
        self.run_dir = run_dir_for(self.job_key, job_key(node)[:8])
        shm_dir = knobs.get(knobs.SHM_DIR, self.config.shm_dir)
        prefix = f"flashckpt-{os.getuid()}-{self.job_key}-r{self.rank}"
        self.slot_paths = [os.path.join(shm_dir, f"{prefix}-{k}") for k in range(self.config.slots)]
        # One more slot, used only while the saver has not answered yet (see _may_hold): the last index.
        self._held_path = os.path.join(shm_dir, f"{prefix}-{self.config.slots}")
        self._slots: list[Slot | None] = [None] * (self.config.slots + 1)
        self._persisting: list[Future | None] = [None] * (self.config.slots + 1)
        self._replicas = replica_restore.ReplicaHook(self)
        self._writer = verify.writer_identity()  # in every snapshot's metadata and in the hello
        self._client = SaverClient(self.run_dir, self.rank, start_timeout=self.config.saver_start_timeout_s,
                                   hello={**self._replicas.hello(), "writer": self._writer})
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-copy")
        self._sums = verify.Checksummer()
        self._verified: set[tuple[str, int]] = set()  # (slot path, seq) checked whole by check_memory()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-prefault")
        self._snapshot: Future | None = None
        self._snapshot_copy: devices.DeviceCopy | None = None
        self._warned_unwaited = False
        self._pending: list[SaveResult] = []
        self._newest_persist: SaveResult | None = None
        self._hooks: list[Any] = []
        self._lock = threading.RLock()
        self._closed = False
        self._leaving = False  # set by an unclean shutdown: unanswered requests are left to the saver
        self._view: lineage.View | None = None
        self._decided = False
        self._unpublished: dict[str, Any] | None = None  # the attempt's record, written at its first save
        self._lineage_writer = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-lineage")
        self._recording: Future | None = None  # that write, while the first save copies
        self._sealing: Future | None = None  # a first save's seal, once that write is done (its error or None)
        self._saves_of: dict[int, int] = {}
        self._pickles = PickleCache()
        self._slots[-1] = Slot.attach(self._held_path)  # a held slot an earlier process left (else None)
        self._seq = self._newest_seq() + 1
        self._record_slot_paths()
        self._requester = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-request")
        self._requester.submit(self._connect_quietly)
        for optimizer in optimizers:
            self.attach_optimizer(optimizer)
        self._atexit = _AtExit(self)
        atexit.register(self._atexit)

    # --- public API ------------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for an overlapped snapshot still being copied.

        For a snapshot of accelerator tensors only, the step's stream waits on the copy's done
        event (no host wait); otherwise the step waits on the host (:meth:`wait_for_snapshot`).
        """
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step()))

    def _before_optimizer_step(self) -> None:
        snapshot, copy = self._snapshot, self._snapshot_copy
        if snapshot is None or snapshot.done() or copy is None:
            self._wait_copy()  # not for a seal still waiting on the attempt's record: the copy is done
            return
        copy.issued.wait()
        if not devices.wait_on_current_streams(copy):
            self._wait_copy()

    def prepare(
        self,
        state: Any = None,
        *,
        files: Mapping[str, Any] | None = None,
        nbytes: int | None = None,
        background: bool = False,
    ) -> None:
        """Create and pre-fault both slots ahead of the first save, sized for ``state`` (and, on
        rank 0, give a new checkpoint directory its identity, which the first save would write).

        With ``background`` the slots are made on a helper thread and this returns at once; a
        save that comes first waits for the slot it writes into (and never for more).
        """
        if self.rank == 0 and not self._decided:  # the directory's identity, ahead of the first save
            try:
                lineage.ensure_identity(self.storage)
            except Exception as exc:  # the first save reports what is wrong with the storage
                logger.debug("[RANK 0] could not read or write the identity of %s yet: %s", self.url, exc)
        device: int | None = None
        if nbytes is None:
            plan = plan_snapshot(normalize_files(self._files(state, files)))
            devices.check_plan(plan)
            nbytes = plan.layout(HEADER_SIZE) + 64 * 1024 + 256 * len(plan.regions)
            device = devices.device_index(plan)
        if background:
            for index in range(len(self.slot_paths)):
                self._background.submit(self._prepare_slot, index, nbytes, device)
            return
        with self._lock:  # never remap a slot under an overlapped copy (or a save) into it
            self.wait_for_snapshot()
            for index in range(len(self.slot_paths)):
                if self._persisting[index] is None or self._persisting[index].done():
                    self._ensure_slot(index, nbytes, pin=device, wait_pin=True)

    def save(
        self,
        step: int,
        state: Any = None,
        *,
        files: Mapping[str, Any] | None = None,
        persist: bool = True,
        async_snapshot: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Snapshot ``state`` (or ``files``) for ``step`` into memory and optionally persist it.

        Call it on every rank (a rank with nothing to save passes ``files={}``): the commit
        waits for every rank. Returns at once with the outcome; it never drops a checkpoint
        silently: a save that cannot happen returns ``SKIPPED`` or ``FAILED`` with the reason.
        """
        started = time.perf_counter()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        result = self._save(step, state, files, persist, async_snapshot, metadata)
        return self._finish(result, started)

    def _save(
        self, step: int, state: Any, files: Mapping[str, Any] | None, persist: bool, async_snapshot: bool | None,
        metadata: Mapping[str, Any] | None,
    ) -> SaveResult:
        specs = normalize_files(self._files(state, files))
        overlap = self.config.async_snapshot if async_snapshot is None else async_snapshot
        if not self._decided:  # neither load() nor start_attempt(): this attempt starts from scratch
            self._begin(None, None, by_save=True)
        if self._unpublished is not None:  # rank 0: the first save of an attempt records it, beside
            record, self._unpublished = self._unpublished, None  # its copy (sealed only once it is written)
            self._recording = self._lineage_writer.submit(self._record_attempt, record)
        with self._lock:
            self.wait_for_snapshot()
            plan = plan_snapshot(specs, self._pickles)
            devices.check_plan(plan)  # before any slot is touched
            if overlap:
                self._warn_if_unwaited()
            extents = len(plan.regions) + len(plan.files)  # the checksum table sits before the metadata
            table, end = verify.place(plan.layout(HEADER_SIZE), extents)
            view = self._lineage_view()
            meta = {
                "format": 1, "step": step, "rank": self.rank, "world_size": self.world_size,
                "job": self.job_key, "time": time.time(), "user": dict(metadata or {}), **plan.metadata(),
                "persist_target": self._persist_target(),  # lets a launcher or the CLI persist it later
                "tag": view.tag(), "checksums": verify.describe(table, extents), "writer": self._writer,
            }
            index, reason = self._choose_slot(hold=end if persist else 0)
            if index is None:
                return SaveResult(step, SaveStatus.SKIPPED, reason)
            seq = self._seq
            sid = self._save_id(step, view) if persist else ""
            if persist:  # in the slot too: a saver persists it even if this process dies before asking
                meta["persist"] = self._persist_request(step, seq, self._path(index), sid)
            raw_meta = json.dumps(meta, separators=(",", ":")).encode()
            pin = devices.device_index(plan)
            front = _CopyFront(plan) if pin is None and self._slot(index) is None else None
            self._sums.release(self._slots[index])  # a checksum of this slot's last snapshot stops
            try:  # a new slot for a host copy is not pre-faulted here: the helper below faults it in
                slot = self._ensure_slot(index, end + len(raw_meta), pin=pin, populate=front is None)
            except SharedMemoryError as exc:
                self._wait_recorded()
                return direct.fallback(self, step, plan, meta, persist, exc)
            if index == len(self.slot_paths):
                self._record_slot_paths()  # a saver that starts after a crash persists the held slot too
            if front is not None:  # from its end, while the copy writes from its start (queued first)
                self._background.submit(slot.fault_in_from_end, front.offset)
            self._seq += 1
            for other in range(len(self.slot_paths)):  # the other slot is created off the training path, sized
                # for this state as this one was (its headroom is added once, by the slot, not twice)
                if other != index and self._slots[other] is None:
                    self._background.submit(self._prepare_slot, other, end + len(raw_meta), devices.device_index(plan))
            if persist and not self._client.connected and self._slots[-1] is None:
                # the saver is not up yet: should the next save find every slot waiting for it, the
                # held slot is ready (made off the training path, where /dev/shm has room for it)
                self._background.submit(self._prepare_held, end + len(raw_meta), devices.device_index(plan))
            slot.begin_write(step, seq)
            if persist:
                slot.mark_persist_requested(seq)
            for offset, blob in plan.blobs():
                slot.write_blob(offset, blob)
            durable: Future | None = Future() if persist else None
            status = SaveStatus.PERSISTING if persist else SaveStatus.IN_MEMORY
            result = SaveResult(step, status, _durable=durable, _poll_commit=self._commit_poller(sid))
            args = (index, slot, plan, step, seq, sid, end, raw_meta, durable, front)
            copy = devices.begin_copy(plan)  # side streams ordered after the work queued so far
            if overlap:
                self._snapshot_copy = copy
                self._snapshot = self._copier.submit(self._complete_overlapped, result, *args, copy)
                result._snapshot = self._snapshot
            else:
                error = self._complete(*args, copy, result=result)
                if error is not None:
                    result.status, result.reason = SaveStatus.FAILED, error
                result._snapshot = self._sealing
        return result

    def _complete_overlapped(self, result: SaveResult, *args: Any) -> str | None:
        """The copy of an overlapped save; a failure turns its result FAILED (with the reason)."""
        error = self._complete(*args)
        if error is not None:
            result.status, result.reason = SaveStatus.FAILED, error
        return error

    def _warn_if_unwaited(self) -> None:
        if self._hooks or self._warned_unwaited:
            return
        self._warned_unwaited = True
        logger.warning(
            "[RANK %d] an overlapped save (async_snapshot) with no optimizer attached: nothing waits for the "
            "copy before the state changes, so the snapshot may hold values of a later step (on a GPU it "
            "will). Pass optimizers=[...] to the Checkpointer or call attach_optimizer(), or call "
            "wait_for_snapshot() before changing the state. (Said once per Checkpointer.)", self.rank)

    def wait_for_snapshot(self) -> str | None:
        """Block until an overlapped snapshot copy has finished (and a first save's seal, which
        waits for the attempt's record to be on storage).

        Returns ``None`` when it succeeded (or there was none), else the reason it failed. A
        failed overlapped copy never raises here (the optimizer's pre-hook calls this: a failed
        checkpoint does not stop training); it is reported instead: its :class:`SaveResult`
        turns ``FAILED`` (``ok`` false, ``reason`` set) once the copy failed, its ``wait()``
        returns ``committed=False`` with the reason, the error is logged, and the slot is
        invalidated, so ``load()`` uses the previous snapshot or commit. Until the copy is done
        an overlapped save's ``status`` is provisional: read it after ``wait()`` or this.
        """
        error = self._wait_copy()
        return self._wait_sealed() or error

    def _wait_copy(self) -> str | None:
        snapshot = self._snapshot
        if snapshot is None:
            return None
        error = snapshot.result()
        if self._snapshot is snapshot:
            self._snapshot = None
            self._snapshot_copy = None
        return error

    def _settle(self) -> None:
        """Wait for an overlapped copy and a pending seal, leaving their outcome to be reported
        (helper threads: the caller's :meth:`wait_for_snapshot` still returns a failure)."""
        for pending in (self._snapshot, self._sealing):
            if pending is not None:
                pending.result()

    def _wait_sealed(self) -> str | None:
        """Wait for a first save whose seal waits on the attempt's record (its error, or None)."""
        sealing = self._sealing
        if sealing is None:
            return None
        error = sealing.result()
        if self._sealing is sealing:
            self._sealing = None
        return error

    def wait(self, timeout: float | None = None) -> PersistResult | None:
        """Wait for every persisting save of this rank to be committed (or to fail).

        Returns the outcome of the newest persisting save, or ``None`` when there was none.
        """
        self.wait_for_snapshot()
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for result in list(self._pending):
            result.wait(left())
        self._pending = [r for r in self._pending if not r._durable.done()]
        newest = self._newest_persist
        return None if newest is None else newest.wait(left())

    def close(self, *, wait: bool = True) -> None:
        """Finish in-flight work, leave the saver, and free this rank's shared memory."""
        if self._closed:
            return
        failed = False
        try:
            if wait:
                self.wait()
            self._warn_if_newest_is_memory_only()
        except Exception:
            failed = True
            raise
        finally:
            self._shutdown(clean=not failed)

    def _warn_if_newest_is_memory_only(self) -> None:
        memory = self.memory_steps()
        committed = self.committed_steps()
        if memory and (not committed or memory[-1] > committed[-1]):
            logger.warning(
                "[RANK %d] step %d was only in memory and is discarded by close() (newest on storage: %s); "
                "save it with persist=True before close() to keep it", self.rank, memory[-1],
                committed[-1] if committed else None,
            )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._shutdown(clean=False)

    # --- saving internals ------------------------------------------------------------------

    def _files(self, state: Any, files: Mapping[str, Any] | None) -> Mapping[str, Any]:
        if (state is None) == (files is None):
            raise ValueError("pass exactly one of `state` (one object) or `files` ({path: object})")
        return files if files is not None else {STATE_FILE.format(rank=self.rank): FileSpec(state)}

    def _complete(
        self, index: int, slot: Slot, plan: Any, step: int, seq: int, sid: str, meta_offset: int, raw_meta: bytes,
        durable: Future | None, front: _CopyFront | None, copy: devices.DeviceCopy | None,
        result: SaveResult | None = None,
    ) -> str | None:
        """Copy the tensors, seal the slot, hand it to the saver. Returns an error or None.

        With ``stream_persist``, a host-memory snapshot that is to be persisted is handed to the
        saver before the copy starts: the saver streams each region as soon as it is in place.
        A save made on the caller's thread (``result``) whose attempt record is still being
        written returns once copied; the record's writer seals it afterwards (:meth:`_seal`),
        and whatever reads or reuses the slots waits for that first (:meth:`_wait_sealed`).
        """
        stream = self.config.stream_persist and durable is not None and not on_device(plan)
        try:
            slot.write_metadata(step, seq, meta_offset, raw_meta)
            if stream:
                self._persisting[index] = durable
                self._requester.submit(self._request_persist, slot, step, seq, sid, durable)
            on_copied = _both(slot.publish_copied if stream else None, front.copied if front is not None else None)
            with devices.on_side_streams(copy):  # device copies go to each device's side stream
                try:
                    copy_regions(plan, slot.buffer, after_region(on_copied))
                finally:
                    if front is not None:
                        front.finish()
            devices.finish_copy(copy)  # sleeps on the done events (no spinning, no device-wide sync)
        except Exception as exc:
            devices.drain(copy)  # copies already issued land before the slot can be reused
            return self._failed(slot, step, durable, stream, exc)
        args = (index, slot, step, seq, sid, durable, stream)
        recording, self._recording = self._recording, None
        if result is not None and not stream and recording is not None and not recording.done():
            # on the record's writer, right after the record (an interpreter that exits meanwhile
            # still runs it); the next save waits for it, so its persist request is queued first
            self._sealing = self._lineage_writer.submit(self._seal_after, result, recording, *args)
            return None
        return self._seal(recording, *args)

    def _seal_after(self, result: SaveResult, *args: Any) -> str | None:
        """Seal a first save once its attempt's record is on storage; a failure turns it FAILED."""
        error = self._seal(*args)
        if error is not None:
            result.status, result.reason = SaveStatus.FAILED, error
        return error

    def _seal(
        self, recording: Future | None, index: int, slot: Slot, step: int, seq: int, sid: str,
        durable: Future | None, stream: bool,
    ) -> str | None:
        """Seal a copied slot once the attempt's record (``recording``) is on storage: a snapshot
        is usable only then, else a restart could not tell which attempt took it. Then hand it
        to the saver and peers."""
        try:
            if recording is not None:
                recording.result()
            slot.seal()
            fault_point("trainer.sealed")  # sealed, the saver not yet asked
        except Exception as exc:
            return self._failed(slot, step, durable, stream, exc)
        # The data's checksums, on a helper thread (see verify); then the peers copy it in the
        # background (a held slot lives only until its persist: never replicated).
        offer = functools.partial(self._replicas.sealed, slot.path, step, seq) if index < len(self.slot_paths) else None
        self._sums.schedule(slot, seq, offer)
        if durable is not None and not stream:
            self._persisting[index] = durable
            try:
                self._requester.submit(self._request_persist, slot, step, seq, sid, durable)
            except RuntimeError:  # the interpreter is exiting (a helper thread sealed it): executors
                self._requester.shutdown(wait=True)  # take no new work; the requests before this go
                self._request_persist(slot, step, seq, sid, durable)  # first, then this one, here
        return None

    def _failed(self, slot: Slot, step: int, durable: Future | None, stream: bool, exc: Exception) -> str:
        slot.invalidate()  # a streaming persist sees this and fails, never publishing the step
        error = f"snapshot of step {step} failed: {type(exc).__name__}: {exc}"
        logger.error("[RANK %d] %s", self.rank, error)
        if durable is not None and not stream:
            durable.set_result({"ok": False, "error": error})
        return error

    def _record_attempt(self, record: dict[str, Any]) -> None:
        try:
            self._publish_attempt(record)
        except Exception:
            self._unpublished = record  # the next save tries again; this one fails with the reason
            raise

    def _wait_recorded(self) -> None:
        """Wait for the attempt's record (written beside its first save's copy): a snapshot is
        usable only once it is on storage, else a restart could not tell which attempt took it."""
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.result()

    def _connect_quietly(self) -> None:
        """Start or find the saver off the training path; a failure is retried at persist time."""
        try:
            self._client.connect()
        except SaverProcessError as exc:
            logger.warning("[RANK %d] saver not reachable yet: %s", self.rank, exc)

    def _announce_slot(self, path: str) -> None:
        """Let the saver map a new or grown slot before its first persist (best effort)."""
        try:
            self._client.connect()
            self._client.request({"op": "attach", "rank": self.rank, "slot": path})
        except SaverProcessError as exc:
            logger.debug("[RANK %d] could not announce slot %s: %s", self.rank, path, exc)

    def _request_persist(self, slot: Slot, step: int, seq: int, sid: str, durable: Future) -> None:
        """Hand a sealed slot to the saver and wait until the rank's files are durable.

        Runs on the request thread, in save order. A saver that dies is restarted and asked
        again once: the slot still holds the snapshot, and rewriting files is idempotent.
        """
        request = {"op": "persist", **self._persist_request(step, seq, slot.path, sid)}
        answer: dict[str, Any] | None = {}
        left = {"ok": False, "error": f"the process left before step {step} was persisted; the node's saver "
                "persists it from the slot"}
        for attempt in range(2):
            if self._leaving:  # the request is in the slot: the saver takes it up when this process is gone
                durable.set_result(left)
                return
            try:
                self._client.connect()
                answer = self._await_answer(self._client.request(request))
                if answer is None:
                    durable.set_result(left)
                    return
                break
            except SaverProcessError as exc:
                answer = {"ok": False, "error": f"the saver is unavailable: {exc}"}
                if attempt == 0:
                    logger.warning("[RANK %d] %s; restarting it and retrying step %d", self.rank, exc, step)
                else:
                    slot.mark_persist_done(seq)  # given up and reported: no saver should pick it up later
        if not answer.get("ok"):
            error = f"rank {self.rank} could not persist step {step}; it stays in memory only: {answer.get('error')}"
            logger.error("[RANK %d] %s", self.rank, error)
            answer = {"ok": False, "error": error}
        durable.set_result(answer)

    def _await_answer(self, future: Future) -> dict[str, Any] | None:
        """The saver's answer to a request; None when this process is exiting on an error and
        ``ERROR_EXIT_WAIT_S`` have passed (the interpreter joins this thread before any atexit
        hook runs, and the answer may wait for a commit that a lost peer never completes)."""
        exiting_since = None
        while True:
            try:
                return future.result(timeout=0.25)
            except concurrent.futures.TimeoutError:
                if self._leaving:
                    return None
                if not _EXITING.is_set() or getattr(sys, "last_value", None) is None:
                    continue  # training goes on, or a clean exit: a clean end waits until it is durable
                exiting_since = exiting_since or time.monotonic()
                if time.monotonic() - exiting_since > ERROR_EXIT_WAIT_S:
                    logger.warning("[RANK %d] exiting on an error with a persist unanswered; the node's saver "
                                   "finishes it (a step a lost peer cannot complete is not committed)", self.rank)
                    return None

    def _persist_request(self, step: int, seq: int, slot_path: str, sid: str) -> dict[str, Any]:
        """What the saver needs to persist one snapshot (sent to it, and kept in the slot)."""
        request = {"rank": self.rank, "world_size": self.world_size, "step": step, "seq": seq, "slot": slot_path,
                   "sid": sid, "tag": self._lineage_view().tag(), "pid": os.getpid(), "writer": self._writer,
                   **self._persist_target()}
        if slot_path == self._held_path:
            request["held"] = True  # the saver unmaps it afterwards: its memory goes once it is released
        return request

    def _save_id(self, step: int, view: lineage.View) -> str:
        """The id of this attempt's next persisted save of ``step``: the same on every rank."""
        count = self._saves_of.get(step, 0)
        self._saves_of[step] = count + 1
        return f"a{view.lineage}" + (f"g{count}" if count else "")

    def _persist_target(self) -> dict[str, Any]:
        """Where and how this rank's snapshots are persisted; every slot's metadata carries it."""
        return {
            "root": self.url, "storage_options": self.config.storage_options,
            "storage_factory": self.config.storage_factory, "layout": self.layout.to_dict(),
            "retention": self.config.retention.to_dict(), "commit_timeout": self.config.commit_timeout_s,
        }

    def _record_slot_paths(self) -> None:
        """Tell the node's savers, present and future, where this rank's slots are."""
        path = os.path.join(self.run_dir, SLOTS_FILE.format(rank=self.rank))
        for _ in range(2):  # again if the saver of an earlier run removed the directory on its way out
            try:
                private_dir(self.run_dir)
                with open(path + ".tmp", "w") as f:
                    held = [self._held_path] if self._slots[-1] is not None else []
                    json.dump({"rank": self.rank, "slots": self.slot_paths + held}, f)
                os.replace(path + ".tmp", path)
                return
            except FileNotFoundError:
                continue
            except (OSError, SaverProcessError):  # best effort: only a crash's recovery needs the record
                return

    def _commit_poller(self, sid: str) -> Any:
        return lambda step, timeout=None: self._poll_commit(step, timeout, sid)

    def _poll_commit(self, step: int, timeout: float | None = None, sid: str = "") -> PersistResult:
        """Watch storage until save ``sid`` of ``step`` is committed or failed (works on every node)."""
        limit = self.config.commit_timeout_s + 30
        deadline = time.monotonic() + (limit if timeout is None else min(timeout, limit))
        marker_dir = Layout.marker_dir(step)
        delay, cap = 0.005, (0.25 if "://" in self.url else 0.05)  # a local listing is cheap; an object store's is not
        while time.monotonic() < deadline:
            try:
                names = set(self.storage.list(marker_dir))
                outcome, failure = commit_protocol.settled(self.storage, step, sid, names)
                if outcome == "committed":
                    return PersistResult(step, True)
                if not names and any(s > step for s in self.committed_steps()):
                    return PersistResult(step, True)  # this rank's marker was there: retention deleted the step
                if outcome == "failed":
                    mine_path = self.layout.rank_marker(step, self.rank, sid=sid)
                    mine = read_json(self.storage, mine_path) if self.storage.exists(mine_path) else {}
                    if failure.get("time", 0) >= mine.get("time", 0):
                        reason = failure.get("reason")
                        logger.error("[RANK %d] step %d was not committed: %s", self.rank, step, reason)
                        return PersistResult(step, False, reason)
            except FlashCkptError as exc:
                logger.warning("[RANK %d] cannot read commit state of step %d: %s", self.rank, step, exc)
            time.sleep(delay)
            delay = min(delay * 2, cap)
        if timeout is not None and timeout < limit:
            raise TimeoutError(f"step {step} was not committed within {timeout}s; it may still be")
        return PersistResult(step, False, f"no commit of step {step} appeared within the commit timeout")

    def _choose_slot(self, hold: int = 0) -> tuple[int | None, str | None]:
        """Pick a slot not being persisted, preferring the one without the newest snapshot.

        With ``hold`` (the size of a save to be persisted), a save that finds every slot waiting
        for a saver that has not answered yet goes into the held slot instead of waiting for it.
        """
        self._release_held()
        deadline = time.monotonic() + self.config.busy_timeout_s
        count = len(self.slot_paths)
        while True:
            free = [i for i in range(count) if not self._busy(i)]
            if free:
                newest = self._newest_index()
                others = [i for i in free if i != newest]
                return (others or free)[0], None
            if hold and self._may_hold(hold):
                return count, None
            for i in range(count):  # a replication copy that borrowed a slot's lock lets go of it
                slot = self._slots[i]
                if slot is not None and locked_by_saver(slot):
                    slot.want()
            reason = (
                f"{'both shared-memory slots' if count == 2 else 'the shared-memory slot'} of rank "
                f"{self.rank} {'are' if count == 2 else 'is'} still being persisted (storage is slower "
                "than the save interval)"
            )
            if self.config.on_slot_busy is BusyPolicy.SKIP or time.monotonic() > deadline:
                return None, reason + "; this save was skipped. Save less often or use faster storage."
            time.sleep(0.01)

    def _may_hold(self, nbytes: int) -> bool:
        """Whether a save may go into the held slot: the saver has not answered yet (so every slot
        waits on its start, not on storage), the held slot is free, and /dev/shm has room for it."""
        if self._client.connected or self._busy(len(self.slot_paths)):
            return False
        if self._slots[-1] is not None:
            return True
        try:
            stat = os.statvfs(os.path.dirname(self._held_path))
        except OSError:
            return False
        return stat.f_bavail * stat.f_frsize > 1.1 * nbytes + (64 << 20)

    def _prepare_held(self, nbytes: int, pin: int | None) -> None:
        """Make the held slot ahead of the save that may need it (before the saver answers)."""
        with self._lock:
            if self._closed or self._slots[-1] is not None or not self._may_hold(nbytes):
                return
            self._settle()
            try:
                self._ensure_slot(len(self.slot_paths), nbytes, pin=pin)
            except SharedMemoryError as exc:  # a save that would need it waits for a slot instead
                logger.debug("[RANK %d] no held slot: %s", self.rank, exc)
                return
            self._record_slot_paths()

    def _release_held(self) -> None:
        """Free the held slot once the saver answers and has persisted it (memory back to ``slots``
        copies); a held snapshot newer than every other slot's stays until a newer save."""
        index = len(self.slot_paths)
        if self._slots[index] is None or not self._client.connected or self._busy(index):
            return
        slot = self._slot(index)
        if slot is None or self._newest_index() == index:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._held_path)
        slot.close()
        self._slots[index], self._persisting[index] = None, None
        self._record_slot_paths()

    def _path(self, index: int) -> str:
        return self.slot_paths[index] if index < len(self.slot_paths) else self._held_path

    def _busy(self, index: int) -> bool:
        """A slot is busy while the saver reads it, and while a persist asked of it is unanswered
        and the rank's own files are not yet durable: global rank 0's answer waits for the commit,
        which waits for every rank, but once this rank's files are written the slot may take the
        next save (a commit held up by a slow or lost rank never stalls this rank's saves)."""
        slot = self._slot(index)
        state = _persist_state(slot) if slot is not None else None
        pending = self._persisting[index]
        if pending is not None and not pending.done() and state != "done":
            return True
        return slot is not None and (locked_by_saver(slot) or state == "outstanding")

    def _slot(self, index: int) -> Slot | None:
        """The mapped slot ``index``; remapped when its file was removed or replaced."""
        slot = self._slots[index]
        if slot is not None and slot.replaced():
            logger.warning("[RANK %d] shared-memory slot %s was removed or replaced under this job; "
                           "its snapshot is gone", self.rank, slot.path)
            self._sums.release(slot)
            slot.close()
            slot = self._slots[index] = None
        if slot is None and index < len(self.slot_paths):  # the held slot is mapped only by the code
            slot = self._slots[index] = Slot.attach(self.slot_paths[index])  # that makes it (or __init__)
        return slot

    def _prepare_slot(self, index: int, nbytes: int, pin: int | None) -> None:
        """Create and pre-fault slot ``index`` in the background, unless a save got there first."""
        with self._lock:
            if self._closed or self._slots[index] is not None or self._busy(index):
                return
            self._settle()
            try:
                self._ensure_slot(index, nbytes, pin=pin)
            except SharedMemoryError as exc:  # the save that needs it reports it
                logger.warning("[RANK %d] could not prepare slot %d ahead of time: %s", self.rank, index, exc)

    def _ensure_slot(self, index: int, nbytes: int, *, pin: int | None, wait_pin: bool = False,
                     populate: bool = True) -> Slot:
        """Slot ``index``, at least ``nbytes`` large; with ``pin`` (a CUDA device index) it is page-locked
        for that device: off the training path (the next saves copy into it pageable until then),
        or here with ``wait_pin``. Call with the engine lock held and no overlapped copy running."""
        slot = self._slot(index)
        size_before = slot.size if slot is not None else 0
        if slot is None:
            slot = self._slots[index] = Slot.create_or_open(self._path(index), nbytes, populate=populate)
        else:
            unsummed = self._sums.release(slot) if nbytes > slot.size else []  # growing remaps it
            slot.ensure_size(nbytes)
            for seq, then in unsummed:  # its bytes are kept
                self._sums.schedule(slot, seq, then)
        if slot.size != size_before and index < len(self.slot_paths):
            self._requester.submit(self._announce_slot, slot.path)
        if pin is not None and self.config.pin_memory and slot.needs_pin:
            if wait_pin:
                slot.pin(pin)
            elif not slot.pin_pending:
                slot.pin_pending = True
                self._background.submit(self._pin_slot, slot, pin)
        return slot

    def _pin_slot(self, slot: Slot, device_index: int) -> None:
        """Page-lock a slot off the training path, without the engine lock (a save may run meanwhile)."""
        try:
            if not self._closed:
                slot.pin(device_index)
        except Exception as exc:  # never fail a save for it: copies into pageable memory are only slower
            logger.warning("[RANK %d] could not page-lock %s: %s", self.rank, slot.path, exc)
        finally:
            slot.pin_pending = False

    def _newest_index(self) -> int | None:
        best, best_seq = None, -1
        for index in range(len(self._slots)):
            slot = self._slot(index)
            header = slot.read_header() if slot is not None else None
            if header is not None and header.state is SlotState.COMPLETE and header.seq > best_seq:
                best, best_seq = index, header.seq
        return best

    def _newest_seq(self) -> int:
        seqs = [0]
        for index in range(len(self._slots)):
            with contextlib.suppress(FlashCkptError):
                slot = self._slot(index)
                header = slot.read_header() if slot is not None else None
                if header is not None:
                    seqs.append(header.seq)
        return max(seqs)

    def _finish(self, result: SaveResult, started: float) -> SaveResult:
        if result.status in (SaveStatus.SKIPPED, SaveStatus.FAILED):
            logger.error("[RANK %d] save of step %d %s: %s", self.rank, result.step, result.status.value, result.reason)
        elif result.status is SaveStatus.PERSISTING:
            self._pending = [r for r in self._pending if not r._durable.done()] + [result]
            self._newest_persist = result
        result.blocking_s = time.perf_counter() - started  # the whole call: what the caller was held
        logger.debug("[RANK %d] step %d %s, blocked %.3fs", self.rank, result.step, result.status.value,
                     result.blocking_s)
        return result

    # --- shutdown --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def _shutdown(self, clean: bool) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if not clean:  # answers still awaited (a commit a lost peer holds up) are not waited for
            self._leaving = True
            self._client.close(clean=False)
        for hook in self._hooks:
            hook.remove()
        self._background.shutdown(wait=True)  # a queued purge (retention after a direct commit) still runs
        self._copier.shutdown(wait=True)
        self._lineage_writer.shutdown(wait=True)  # a first save's seal hands its persist to the requester
        self._sums.wait()  # slots left for a restart keep their checksums
        self._sums.close()
        self._requester.shutdown(wait=True)
        self._replicas.close()
        self._client.close(clean=clean)
        for slot in self._slots:
            if slot is not None:
                if clean:
                    slot.unlink()
                slot.close()
        self._slots = [None] * len(self._slots)


class _CopyFront:
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


def _both(first: Any, second: Any) -> Any:
    """One per-region callback that calls both (either may be None)."""
    if first is None or second is None:
        return first or second

    def both(regions: int) -> None:
        first(regions)
        second(regions)

    return both


class _AtExit:
    """At interpreter exit: wait for in-flight persisting, keep memory for a restart."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._ref = weakref.ref(checkpointer)

    def __call__(self) -> None:
        checkpointer = self._ref()
        if checkpointer is None or checkpointer._closed:
            return
        failing = getattr(sys, "last_value", None) is not None  # the interpreter printed an uncaught error
        try:
            checkpointer.wait(ERROR_EXIT_WAIT_S if failing else None)
        except concurrent.futures.TimeoutError:
            logger.warning("[RANK %d] exiting on an error with checkpoints still being persisted or committed; "
                           "the node's saver finishes them (a step a lost peer cannot complete is not committed)",
                           checkpointer.rank)
        except Exception as exc:
            logger.error("[RANK %d] in-flight checkpoints did not finish at exit: %s", checkpointer.rank, exc)
        checkpointer._shutdown(clean=False)


def _persist_state(slot: Slot) -> str | None:
    """For a complete snapshot that was to be persisted: ``"done"`` once the saver has written this
    rank's files (its done or failed marker), ``"outstanding"`` while no saver has finished it
    (e.g. its process died); else None."""
    try:
        header = slot.read_header()
    except CorruptCheckpointError:
        return None
    if header is None or header.state is not SlotState.COMPLETE or header.persist_req != header.seq:
        return None
    return "done" if header.persist_done >= header.seq else "outstanding"

