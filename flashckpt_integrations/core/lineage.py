"""Directory identity and attempt lineage: which snapshots and commits belong to this run.

A checkpoint directory gets an identity the first time a job decides how it starts in it
(``.flashckpt/identity.json``, created atomically: one writer wins, every rank reads the winner).
Each attempt (one :class:`~flashckpt_integrations.Checkpointer` of each rank, from its start to
its end or crash) gets a lineage record, ``.flashckpt/lineages/<n>.json``, numbered in the order
attempts began. A record names its parent: the lineage whose checkpoint the attempt resumed,
and the step it resumed (``fork_step``); an attempt that starts from scratch has none.

What an attempt may load is its own lineage, then its parent's up to the fork step, then the
grandparent's up to the smaller of the two fork steps, and so on: a :class:`View`. Every memory
snapshot and every commit record carries the directory identity and the lineage that wrote it
(:meth:`View.tag`), so a restart never loads the state of an abandoned attempt (one that a
later attempt did not resume), nor a snapshot of a directory that was deleted or replaced.
Snapshots and commits written before lineages existed count as lineage 0.

Call order, from the checkpointer:

1. :func:`provisional_view` (any rank, no writes): before the attempt has decided, what the
   newest lineage accepts; ``load()`` and the adapters' queries see that.
2. :func:`begin` (rank 0, once per attempt, inside a collective): creates the identity if it is
   missing, numbers the attempt, returns its :class:`View`, which rank 0 shares. A fresh start
   is recorded at once; a resume is recorded by :func:`publish` at the attempt's first save.
3. ``View.accepts(tag, step)`` filters snapshots and commits; ``View.tag()`` is stamped on
   every new snapshot and carried by its persist request into the commit record.
4. :func:`order_key` orders commits across lineages (retention, the tracker): every step of a
   later lineage counts as newer than every step of an earlier one.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .layout import META_DIR
from .storage import Storage, create_exclusive

IDENTITY_FILE = f"{META_DIR}/identity.json"
LINEAGE_DIR = f"{META_DIR}/lineages"
LEGACY = 0
"""The lineage of snapshots and commits that carry none (written before lineages existed)."""


@dataclass(frozen=True)
class View:
    """What one attempt may load: ``caps`` lists ``(lineage, newest step accepted or None)``."""

    dir_id: str | None
    lineage: int | None
    """This attempt's own lineage; None while it has not decided (a provisional view)."""
    caps: tuple[tuple[int, int | None], ...]

    def accepts(self, tag: Mapping[str, Any] | None, step: int) -> bool:
        """Whether a snapshot or commit of ``step`` stamped with ``tag`` belongs to this view."""
        tag = tag or {}
        if tag.get("dir") is not None and tag.get("dir") != self.dir_id:
            return False
        lineage = int(tag.get("lineage", LEGACY))
        for accepted, cap in self.caps:
            if accepted == lineage:
                return cap is None or step <= cap
        return False

    def foreign_directory(self, tag: Mapping[str, Any] | None) -> bool:
        """The tag names another incarnation of the directory (it was deleted or replaced)."""
        return bool(tag) and tag.get("dir") is not None and tag.get("dir") != self.dir_id

    def tag(self) -> dict[str, Any]:
        """The stamp of this attempt's snapshots and commits."""
        if self.lineage is None:
            raise RuntimeError("a provisional view has no lineage to stamp")
        return {"dir": self.dir_id, "lineage": self.lineage}

    def to_dict(self) -> dict[str, Any]:
        return {"dir_id": self.dir_id, "lineage": self.lineage, "caps": [list(c) for c in self.caps]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> View:
        return cls(data["dir_id"], data["lineage"], tuple((int(a), b) for a, b in data["caps"]))


def read_identity(storage: Storage) -> str | None:
    """The directory's identity, or None when it has none (new, or deleted since)."""
    if not storage.exists(IDENTITY_FILE):
        return None
    return str(json.loads(storage.read(IDENTITY_FILE))["id"])


def ensure_identity(storage: Storage) -> str:
    """The directory's identity, created atomically if it has none."""
    proposal = {"id": uuid.uuid4().hex, "created": time.time(), "host": socket.gethostname()}
    create_exclusive(storage, IDENTITY_FILE, json.dumps(proposal, indent=1).encode())
    identity = read_identity(storage)
    if identity is None:
        raise RuntimeError(f"{IDENTITY_FILE} vanished right after it was created in {storage.url}")
    return identity


def read_records(storage: Storage) -> dict[int, dict[str, Any]]:
    """Every lineage record of the directory, by number."""
    records = {}
    for name in storage.list(LINEAGE_DIR):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.isdigit():
            records[int(stem)] = json.loads(storage.read(f"{LINEAGE_DIR}/{name}"))
    return records


def _chain(records: Mapping[int, Mapping[str, Any]], start: int) -> tuple[tuple[int, int | None], ...]:
    caps: list[tuple[int, int | None]] = []
    cap: int | None = None
    lineage: int | None = start
    while lineage is not None and all(lineage != seen for seen, _ in caps):
        caps.append((lineage, cap))
        record = records.get(lineage)
        if record is None:
            break
        fork = record.get("fork_step")
        if fork is not None:
            cap = int(fork) if cap is None else min(cap, int(fork))
        parent = record.get("parent")
        lineage = None if parent is None else int(parent)
    return tuple(caps)


def provisional_view(storage: Storage) -> View:
    """What a restart sees before it decides: the newest lineage and its ancestry (no writes)."""
    dir_id = read_identity(storage)
    records = read_records(storage) if dir_id is not None else {}
    newest = max(records, default=None)
    caps = _chain(records, newest) if newest is not None else ((LEGACY, None),)
    return View(dir_id, None, caps)


def view_of(storage: Storage, tag: Mapping[str, Any] | None) -> View:
    """The view of the attempt that stamped ``tag`` (what a launcher persisting its snapshot compares with)."""
    tag = tag or {}
    number = int(tag.get("lineage", LEGACY))
    caps = _chain(read_records(storage), number) if number != LEGACY else ((LEGACY, None),)
    return View(tag.get("dir"), number, caps)


def begin(storage: Storage, parent: Mapping[str, Any] | None, fork_step: int | None, *,
          record_fresh: bool = True) -> tuple[View, dict[str, Any]]:
    """Open a new attempt (rank 0): resumed from ``parent``'s tag at ``fork_step``, or from scratch.

    Returns its view and its record. A fresh start is recorded at once (from now on, what came
    before is abandoned, even if this attempt never saves), unless ``record_fresh`` is false (the
    first save opens it and records it while it copies); a resume only reserves the next
    number, and :func:`publish` records it with the attempt's first save: an attempt that
    resumes and never saves (a crash right away, a script that only inspects) changes nothing.
    """
    dir_id = ensure_identity(storage)
    parent_lineage = None
    if parent is not None:
        if parent.get("dir") is not None and parent.get("dir") != dir_id:
            raise RuntimeError("the checkpoint resumed from belongs to another incarnation of this directory")
        parent_lineage = int(parent.get("lineage", LEGACY))
    record = {
        "parent": parent_lineage, "fork_step": fork_step if parent_lineage is not None else None,
        "dir": dir_id, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
    }
    records = read_records(storage)
    record["lineage"] = max(records, default=LEGACY) + 1
    if parent_lineage is None and record_fresh:
        record = publish(storage, record)
    records[record["lineage"]] = record
    return View(dir_id, record["lineage"], _chain(records, record["lineage"])), record


def publish(storage: Storage, record: dict[str, Any]) -> dict[str, Any]:
    """Write an attempt's record under its number; a number another attempt took meanwhile moves up
    (the returned record says which it got)."""
    number = int(record["lineage"])
    while not create_exclusive(storage, f"{LINEAGE_DIR}/{number:08d}.json",
                               json.dumps({**record, "lineage": number}, indent=1).encode()):
        number += 1
    return {**record, "lineage": number}


def order_key(record: Mapping[str, Any] | None, step: int) -> tuple[int, int]:
    """Newer-than order of commits: by lineage first (a later attempt's steps are newer), then step."""
    return (int((record or {}).get("lineage", LEGACY)), step)
