"""One rank's shared-memory slots: which slot a save takes, their lifetime, the held slot, pinning.

Call order, from the checkpointer: ``RankSlots(...)`` (maps what an earlier process of this rank
left) -> ``record_paths()`` -> for each save, under ``lock``: ``choose(hold)`` -> ``next_seq()`` ->
``ensure(index, nbytes, ...)`` (creates or grows it) -> ``mark_persisting(index, durable)`` once a
persist is asked of it; ``prepare(...)`` and ``prepare_held(...)`` make slots off the training path;
``close(clean)`` at the end.

A rank has ``config.slots`` slots (two: one is written while the other may still be persisted)
and one more, the *held* slot (the last index), taken only while the node's saver has not
answered yet, so that a save that finds every slot waiting for a saver still starting is not
skipped. Sequence numbers order the snapshots of a rank across its slots and restarts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..._utils.locks import lock_held
from ...config import BusyPolicy, CheckpointerConfig
from ...errors import CorruptCheckpointError, FlashCkptError, SaverProcessError, SharedMemoryError
from ..client import private_dir
from ..protocol import SLOTS_FILE
from ..shm_buffer import Slot, SlotState
from ..verify import Checksummer

logger = logging.getLogger(__name__)


def locked_by_saver(slot: Slot) -> bool:
    """The saver holds an exclusive lock on a slot file while it persists it."""
    return lock_held(slot.path, exclusive_only=True)


def persist_state(slot: Slot) -> str | None:
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


class RankSlots:
    """The slots of one rank (see the module docstring). ``lock`` guards mapping and choosing them."""

    def __init__(self, config: CheckpointerConfig, rank: int, prefix: str, run_dir: str, *, sums: Checksummer,
                 saver_up: Callable[[], bool], announce: Callable[[str], None]) -> None:
        self.config, self.rank, self.run_dir = config, rank, run_dir
        self.paths = [f"{prefix}-{k}" for k in range(config.slots)]
        self.held_path = f"{prefix}-{config.slots}"
        self.lock = threading.RLock()
        self.closed = False
        self._sums = sums
        self._saver_up = saver_up  # whether the node's saver has answered this rank
        self._announce = announce  # lets the saver map a new or grown slot
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-prefault")
        """Slot work off the training path: creating, pre-faulting, pinning (and a direct commit's retention)."""
        self._slots: list[Slot | None] = [None] * (config.slots + 1)
        self._persisting: list[Future | None] = [None] * (config.slots + 1)
        self._slots[-1] = Slot.attach(self.held_path)  # a held slot an earlier process left (else None)
        self._seq = self.newest_seq() + 1

    @property
    def count(self) -> int:
        """How many slots saves rotate through (the held slot not counted)."""
        return len(self.paths)

    def indices(self) -> range:
        """Every slot's index, the held slot's (``count``) last."""
        return range(len(self._slots))

    def path(self, index: int) -> str:
        return self.paths[index] if index < len(self.paths) else self.held_path

    def is_held(self, index: int) -> bool:
        return index == len(self.paths)

    def next_seq(self) -> int:
        """The sequence number of the next snapshot (taken: a later call gets a newer one)."""
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def renumber(self) -> None:
        """After a slot was filled by someone else (a peer's replica): the next save counts as newer."""
        self._seq = max(self._seq, self.newest_seq() + 1)

    # --- choosing --------------------------------------------------------------------------------

    def choose(self, hold: int = 0) -> tuple[int | None, str | None]:
        """Pick a slot not being persisted, preferring the one without the newest snapshot.

        With ``hold`` (the size of a save to be persisted), a save that finds every slot waiting
        for a saver that has not answered yet goes into the held slot instead of waiting for it.
        """
        self.release_held()
        deadline = time.monotonic() + self.config.busy_timeout_s
        while True:
            free = [i for i in range(self.count) if not self.busy(i)]
            if free:
                newest = self.newest_index()
                others = [i for i in free if i != newest]
                return (others or free)[0], None
            if hold and self.may_hold(hold):
                return self.count, None
            for i in range(self.count):  # a replication copy that borrowed a slot's lock lets go of it
                slot = self._slots[i]
                if slot is not None and locked_by_saver(slot):
                    slot.want()
            if self.config.on_slot_busy is BusyPolicy.SKIP or time.monotonic() > deadline:
                return None, self._busy_reason() + "; this save was skipped. Save less often or use faster storage."
            time.sleep(0.01)

    def _busy_reason(self) -> str:
        two = self.count == 2
        return (f"{'both shared-memory slots' if two else 'the shared-memory slot'} of rank {self.rank} "
                f"{'are' if two else 'is'} still being persisted (storage is slower than the save interval)")

    def busy(self, index: int) -> bool:
        """A slot is busy while the saver reads it, and while a persist asked of it is unanswered
        and the rank's own files are not yet durable: global rank 0's answer waits for the commit,
        which waits for every rank, but once this rank's files are written the slot may take the
        next save (a commit held up by a slow or lost rank never stalls this rank's saves)."""
        slot = self.get(index)
        state = persist_state(slot) if slot is not None else None
        pending = self._persisting[index]
        if pending is not None and not pending.done() and state != "done":
            return True
        return slot is not None and (locked_by_saver(slot) or state == "outstanding")

    def mark_persisting(self, index: int, durable: Future) -> None:
        """A persist was asked of slot ``index``; ``durable`` resolves once its files are written."""
        self._persisting[index] = durable

    def persisting_done(self, index: int) -> bool:
        pending = self._persisting[index]
        return pending is None or pending.done()

    def newest_index(self) -> int | None:
        best, best_seq = None, -1
        for index in self.indices():
            slot = self.get(index)
            header = slot.read_header() if slot is not None else None
            if header is not None and header.state is SlotState.COMPLETE and header.seq > best_seq:
                best, best_seq = index, header.seq
        return best

    def newest_seq(self) -> int:
        seqs = [0]
        for index in self.indices():
            with contextlib.suppress(FlashCkptError):
                slot = self.get(index)
                header = slot.read_header() if slot is not None else None
                if header is not None:
                    seqs.append(header.seq)
        return max(seqs)

    # --- the held slot ---------------------------------------------------------------------------

    def may_hold(self, nbytes: int) -> bool:
        """Whether a save may go into the held slot: the saver has not answered yet (so every slot
        waits on its start, not on storage), the held slot is free, and /dev/shm has room for it."""
        if self._saver_up() or self.busy(self.count):
            return False
        if self._slots[-1] is not None:
            return True
        try:
            stat = os.statvfs(os.path.dirname(self.held_path))
        except OSError:
            return False
        return stat.f_bavail * stat.f_frsize > 1.1 * nbytes + (64 << 20)

    def held_missing(self) -> bool:
        return self._slots[-1] is None

    def prepare_held(self, nbytes: int, pin: int | None, settle: Callable[[], None]) -> None:
        """Make the held slot ahead of the save that may need it (before the saver answers)."""
        with self.lock:
            if self.closed or self._slots[-1] is not None or not self.may_hold(nbytes):
                return
            settle()
            try:
                self.ensure(self.count, nbytes, pin=pin)
            except SharedMemoryError as exc:  # a save that would need it waits for a slot instead
                logger.debug("[RANK %d] no held slot: %s", self.rank, exc)
                return
            self.record_paths()

    def release_held(self) -> None:
        """Free the held slot once the saver answers and has persisted it (memory back to ``slots``
        copies); a held snapshot newer than every other slot's stays until a newer save."""
        index = self.count
        if self._slots[index] is None or not self._saver_up() or self.busy(index):
            return
        slot = self.get(index)
        if slot is None or self.newest_index() == index:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.held_path)
        slot.close()
        self._slots[index], self._persisting[index] = None, None
        self.record_paths()

    # --- mapping, creating, pinning --------------------------------------------------------------

    def get(self, index: int) -> Slot | None:
        """The mapped slot ``index``; remapped when its file was removed or replaced.

        Under ``lock``: a slot the helper is making is not attached a second time beside it (the
        helper's mapping, dropped, would be unmapped while CUDA still has it registered)."""
        with self.lock:
            slot = self._slots[index]
            if slot is not None and slot.replaced():
                logger.warning("[RANK %d] shared-memory slot %s was removed or replaced under this job; "
                               "its snapshot is gone", self.rank, slot.path)
                self._sums.release(slot)
                slot.close()
                slot = self._slots[index] = None
            if slot is None and index < self.count:  # the held slot is mapped only by the code
                slot = self._slots[index] = Slot.attach(self.paths[index])  # that makes it (or __init__)
            return slot

    def mapped(self, index: int) -> Slot | None:
        """Slot ``index`` as mapped now (not remapped, nor attached)."""
        return self._slots[index]

    def forget(self, index: int) -> None:
        """Unmap slot ``index`` (someone else may grow its file): the next ``get`` maps it afresh."""
        slot, self._slots[index] = self._slots[index], None
        if slot is not None:
            slot.close()

    def prepare(self, index: int, nbytes: int, pin: int | None, settle: Callable[[], None]) -> None:
        """Create and pre-fault slot ``index`` in the background, unless a save got there first."""
        with self.lock:
            if self.closed or self._slots[index] is not None or self.busy(index):
                return
            settle()
            try:
                self.ensure(index, nbytes, pin=pin)
            except SharedMemoryError as exc:  # the save that needs it reports it
                logger.warning("[RANK %d] could not prepare slot %d ahead of time: %s", self.rank, index, exc)

    def create_together(self, indices: range, nbytes: int) -> None:
        """Create the missing slots among ``indices`` at once, a thread each: making a slot is kernel
        work (allocating and mapping its pages) that runs in parallel, and ``prepare()`` has the
        cores to itself (1 GiB: 1.4 s for two slots instead of 1.7 s; 4 GiB: 6.8 s instead of 15 s).
        A slot that cannot be made is left to :meth:`ensure`, which reports why. Call with ``lock``."""
        missing = [index for index in indices if self.get(index) is None]
        if len(missing) < 2:
            return
        with ThreadPoolExecutor(len(missing), thread_name_prefix="flashckpt-prepare") as pool:
            made = [pool.submit(Slot.create_or_open, self.path(index), nbytes) for index in missing]
        for index, future in zip(missing, made):
            if future.exception() is None:
                slot = self._slots[index] = future.result()
                self._announce(slot.path)

    def ensure(self, index: int, nbytes: int, *, pin: int | None, wait_pin: bool = False,
               populate: bool = True) -> Slot:
        """Slot ``index``, at least ``nbytes`` large; with ``pin`` (a CUDA device index) it is page-locked
        for that device: off the training path (the next saves copy into it pageable until then),
        or here with ``wait_pin``. Call with ``lock`` held and no overlapped copy running."""
        slot = self.get(index)
        size_before = slot.size if slot is not None else 0
        if slot is None:
            slot = self._slots[index] = Slot.create_or_open(self.path(index), nbytes, populate=populate)
        else:
            unsummed = self._sums.release(slot) if nbytes > slot.size else []  # growing remaps it
            slot.ensure_size(nbytes)
            for seq, then in unsummed:  # its bytes are kept
                self._sums.schedule(slot, seq, then)
        if slot.size != size_before and index < self.count:
            self._announce(slot.path)
        if pin is not None and self.config.pin_memory and slot.needs_pin:
            if wait_pin:
                slot.pin(pin)
            elif not slot.pin_pending:
                slot.pin_pending = True
                self.helper.submit(self._pin, slot, pin)
        return slot

    def _pin(self, slot: Slot, device_index: int) -> None:
        """Page-lock a slot off the training path, without ``lock`` (a save may run meanwhile)."""
        try:
            if not self.closed:
                slot.pin(device_index)
        except Exception as exc:  # never fail a save for it: copies into pageable memory are only slower
            logger.warning("[RANK %d] could not page-lock %s: %s", self.rank, slot.path, exc)
        finally:
            slot.pin_pending = False

    def record_paths(self) -> None:
        """Tell the node's savers, present and future, where this rank's slots are."""
        path = os.path.join(self.run_dir, SLOTS_FILE.format(rank=self.rank))
        for _ in range(2):  # again if the saver of an earlier run removed the directory on its way out
            try:
                private_dir(self.run_dir)
                with open(path + ".tmp", "w") as f:
                    held = [self.held_path] if self._slots[-1] is not None else []
                    json.dump({"rank": self.rank, "slots": self.paths + held}, f)
                os.replace(path + ".tmp", path)
                return
            except FileNotFoundError:
                continue
            except (OSError, SaverProcessError):  # best effort: only a crash's recovery needs the record
                return

    def stop_background(self) -> None:
        """Let queued slot work (and a queued retention) finish; no new work is taken."""
        self.helper.shutdown(wait=True)

    def close(self, clean: bool) -> None:
        """Unmap every slot; ``clean``: remove their files too (nothing is left for a restart)."""
        for slot in self._slots:
            if slot is not None:
                if clean:
                    slot.unlink()
                slot.close()
        self._slots = [None] * len(self._slots)
