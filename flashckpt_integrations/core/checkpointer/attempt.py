"""How one attempt of a job starts, and what it may load: its lineage, decided once, collectively.

Call order (every rank): before anything else the attempt's queries see the provisional view of
:mod:`..lineage` (``view()``); then once, collectively, the attempt decides: ``start(step |
None)`` (``load()`` says what it loaded; code that resumed through another loader says it through
``Checkpointer.start_attempt``) or ``begin(None, None, by_save=True)`` (the first save: a fresh
start). On rank 0 the attempt's record is then written: at once, or, for a first save, by
``record_first_save()`` on the attempt's writer thread while that save copies; the save's seal
waits for it (``wait_recorded()``), and whatever reads or reuses the slots waits for the seal
(``wait_sealed()``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import collectives, lineage
from ..layout import commit_record, commit_records
from ..storage import Storage

logger = logging.getLogger(__name__)


class Attempt:
    """The lineage decisions of one rank's attempt (see the module docstring)."""

    def __init__(self, storage: Storage, url: str, rank: int, world_size: int, process_group: Any) -> None:
        self.storage, self.url = storage, url
        self.rank, self.world_size, self.process_group = rank, world_size, process_group
        self.decided = False
        self._view: lineage.View | None = None
        self._unpublished: dict[str, Any] | None = None  # the attempt's record, written at its first save
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-lineage")
        self._recording: Future | None = None  # that write, while the first save copies
        self.sealing: Future | None = None
        """A first save's seal, queued after that write (its error or None)."""

    def view(self) -> lineage.View:
        """What this attempt may load: decided, or (before it decides) the newest lineage's view."""
        if self._view is None:
            self._view = lineage.provisional_view(self.storage)
        return self._view

    def commit_records(self) -> dict[int, dict[str, Any]]:
        """This lineage's commit records, by step."""
        view = self.view()
        return {step: record for step, record in commit_records(self.storage).items() if view.accepts(record, step)}

    def any_record(self, step: int, records: Mapping[int, dict[str, Any]]) -> dict[str, Any] | None:
        """The commit record of ``step``: this lineage's, or (an explicit older step) any commit's."""
        return records.get(step) or commit_record(self.storage, step)

    def begin(self, parent: Mapping[str, Any] | None, fork_step: int | None, *, by_save: bool = False) -> None:
        """Record this attempt's lineage (rank 0) and share its view with every rank.

        ``by_save``: the first save opens the attempt; its record is written while that save
        copies (the save seals its slot only once the record is on storage)."""
        if self.world_agrees():
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
        self._view, self.decided = view, True
        logger.debug("[RANK %d] attempt lineage %s (resumed %s at %s)", self.rank, view.lineage,
                     parent and parent.get("lineage"), fork_step)

    def world_agrees(self) -> bool:
        """Whether the ranks can agree through a collective (a process group, or one rank)."""
        return self.world_size == 1 or collectives.initialized()

    # --- the attempt's record, beside its first save ---------------------------------------------

    def record_first_save(self) -> None:
        """Rank 0, at a save: write the attempt's record if it is not written yet (on the writer)."""
        if self._unpublished is not None:
            record, self._unpublished = self._unpublished, None
            self._recording = self._writer.submit(self._record, record)

    def take_recording(self) -> Future | None:
        """The record's write in flight, for the save that seals after it (handed over once)."""
        recording, self._recording = self._recording, None
        return recording

    def seal_after(self, fn: Callable[..., str | None], *args: Any) -> None:
        """Queue a first save's seal on the writer, right after the record (see ``wait_sealed``)."""
        self.sealing = self._writer.submit(fn, *args)

    def wait_recorded(self) -> None:
        """Wait for the attempt's record (written beside its first save's copy): a snapshot is
        usable only once it is on storage, else a restart could not tell which attempt took it."""
        recording = self.take_recording()
        if recording is not None:
            recording.result()

    def wait_sealed(self) -> str | None:
        """Wait for a first save whose seal waits on the attempt's record (its error, or None)."""
        sealing = self.sealing
        if sealing is None:
            return None
        error = sealing.result()
        if self.sealing is sealing:
            self.sealing = None
        return error

    def _record(self, record: dict[str, Any]) -> None:
        try:
            published = lineage.publish(self.storage, record)
        except Exception:
            self._unpublished = record  # the next save tries again; this one fails with the reason
            raise
        if published["lineage"] != record["lineage"]:
            logger.error("[RANK %d] another job started attempt %d in %s at the same time; this job's snapshots "
                         "are stamped with it too and may not load after a restart. Give each job its own "
                         "checkpoint directory", self.rank, record["lineage"], self.url)

    def close(self) -> None:
        """Finish the record's write and a first save's seal (which hands its persist on)."""
        self._writer.shutdown(wait=True)
