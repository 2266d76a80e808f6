"""Memory snapshots taken by another number of ranks: what a restore that reshards reads from.

A job restarted on fewer (or more) ranks finds the old ranks' snapshots in the shared memory of
the nodes it runs on: the slots of the old ranks of each node, and the replicas a node holds for
ranks of nodes that are gone. State saved in a format that reshards (DCP's: global metadata and
items) can be read from them onto the new ranks, without reading storage.

Call order::

    sources = open_sources(ck, newest_commit)   # collective; None when memory cannot serve a step
        found = node_snapshots(ck)                  # this node's complete snapshots of the job (other world sizes)
        choice = choose(ck, found, newest_commit)   # collective: the step, the old world size, who serves which
        Sources.open(ck, choice, found)             # collective: maps and verifies the old ranks this rank serves
    sources.slots / sources.readable()          # (slot, metadata) by old rank: served here / readable in place
    sources.close()

A step is chosen only when every old rank's snapshot of it is held by some new rank and it is at
least as new as the newest commit; each old rank is served by one of the new ranks that hold it:
old rank r of W by new rank r * W' // W when that one holds it (FSDP and DTensor shard in
contiguous blocks, so its rows are mostly that rank's), else spread over the holders by old rank.
Every served snapshot is verified by its server against its checksum table, on the mapping that
is then read; if one fails, every rank gets ``None`` from :meth:`Sources.open` and loads from
storage. A new rank also reads in place the other snapshots of its node that their servers
verified (:meth:`Sources.readable`); only the items of other nodes' old ranks are sent.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

from .. import knobs
from ..errors import CorruptCheckpointError
from . import collectives
from .rescue import job_replicas, job_slots
from .shm_buffer import Slot, complete_snapshot
from .verify import check_attached

logger = logging.getLogger(__name__)

_HOST = socket.gethostname()
"""With the slot's path, names a snapshot across the job's nodes (nodes on one host have shared-memory
directories of their own)."""


@dataclass(frozen=True)
class Snapshot:
    """One complete snapshot found in this node's shared memory."""

    path: str
    rank: int
    world_size: int
    step: int
    seq: int


@dataclass
class Choice:
    step: int
    world_size: int
    """The old job's number of ranks."""
    owners: dict[int, int]
    """Old rank -> the new rank that serves its snapshot."""


def open_sources(ck: Any, newest_commit: int | None) -> Sources | None:
    """The old ranks' snapshots to reshard from, when the new job's memory holds every old rank's
    snapshot of a step of a job of another number of ranks, at least as new as ``newest_commit``
    (collective; the same answer on every rank); else None."""
    found = node_snapshots(ck)
    choice = choose(ck, found, newest_commit)
    return None if choice is None else Sources.open(ck, choice, found)


def node_snapshots(ck: Any) -> list[Snapshot]:
    """This node's complete snapshots of ``ck``'s job taken by a job of another world size (its slots
    and the peer replicas it holds), the newest of each (old rank, step); only those of the lineage
    this attempt continues (as for this world size's own snapshots)."""
    shm_dir = knobs.get(knobs.SHM_DIR, ck.config.shm_dir)
    accepted = []
    for snap, tag in _held(ck.url, ck.config.job_id, shm_dir):
        if snap.world_size == ck.world_size:
            continue
        if not ck.attempt.view().accepts(tag, snap.step):  # an attempt this one does not continue
            logger.info("[RANK %d] the snapshot of old rank %d (step %d) in %s belongs to an attempt this one does "
                        "not continue; not used", ck.rank, snap.rank, snap.step, snap.path)
            continue
        accepted.append(snap)
    return _newest_of_each(accepted)


def held_snapshots(url: str, job_id: str | None, shm_dir: str) -> list[Snapshot]:
    """The complete snapshots of the job saving to ``url`` in this host's shared memory (slots and
    peer replicas, every world size), the newest of each (world size, rank, step): what a restart on
    this host could restore from (``flashckpt ls``)."""
    return _newest_of_each([snap for snap, _ in _held(url, job_id, shm_dir)])


def _held(url: str, job_id: str | None, shm_dir: str) -> list[tuple[Snapshot, Any]]:
    paths: list[str] = []
    for found in (job_slots(url, job_id, shm_dir), job_replicas(url, job_id, shm_dir)):
        for rank_paths in found.values():
            paths.extend(rank_paths)
    held = []
    for path in sorted(set(paths)):
        try:
            with complete_snapshot(path) as found:
                if found is None:
                    continue
                _, header, meta = found
        except (OSError, CorruptCheckpointError) as exc:
            logger.debug("skipping %s: %s", path, exc)
            continue
        if "rank" in meta and "world_size" in meta:
            held.append((Snapshot(path, int(meta["rank"]), int(meta["world_size"]), header.step, header.seq),
                         meta.get("tag")))
    return held


def _newest_of_each(snaps: list[Snapshot]) -> list[Snapshot]:
    newest: dict[tuple[int, int, int], Snapshot] = {}
    for snap in snaps:
        key = (snap.world_size, snap.rank, snap.step)
        if key not in newest or newest[key].seq < snap.seq:
            newest[key] = snap
    return sorted(newest.values(), key=lambda s: (s.world_size, s.step, s.rank))


def newest_elsewhere(ck: Any) -> tuple[int, int] | None:
    """``(step, old world size)`` of the newest snapshot that a job of another number of ranks left
    in the memory of any of the new job's nodes (collective; the same answer on every rank)."""
    mine = max(((s.step, s.world_size) for s in node_snapshots(ck)), default=None)
    views = collectives.all_gather_object(mine, ck.world_size, ck.process_group)
    return max((tuple(v) for v in views if v is not None), default=None)


def choose(ck: Any, found: list[Snapshot], newest_commit: int | None) -> Choice | None:
    """The newest step whose every old rank is held by some new rank, not older than ``newest_commit``
    (collective; the same answer on every rank)."""
    mine = sorted({(s.world_size, s.step, s.rank) for s in found})
    views = collectives.all_gather_object([list(t) for t in mine], ck.world_size, ck.process_group)
    holders: dict[tuple[int, int], dict[int, list[int]]] = {}
    for new_rank, held in enumerate(views):
        for world, step, rank in held:
            holders.setdefault((world, step), {}).setdefault(rank, []).append(new_rank)  # in rank order
    complete = [(step, world) for (world, step), ranks in holders.items()
                if set(ranks) >= set(range(world)) and (newest_commit is None or step >= newest_commit)]
    if not complete:
        return None
    step, world = max(complete)
    by_rank = holders[(world, step)]

    def owner(rank: int) -> int:
        """The new rank whose share of the state this old rank's rows most likely are (a contiguous
        block, as FSDP and DTensor shard), when it holds it: then nothing crosses the process group."""
        held, block = by_rank[rank], rank * ck.world_size // world
        return block if block in held else held[rank % len(held)]

    return Choice(step, world, {rank: owner(rank) for rank in range(world)})


@dataclass
class Sources:
    """The snapshots of the old ranks this rank serves, mapped and verified (``slots``), and the other
    old ranks' snapshots on this rank's node that their servers verified (``local``: read in place
    rather than sent over the process group)."""

    choice: Choice
    slots: dict[int, tuple[Slot, dict[str, Any]]] = field(default_factory=dict)
    local: dict[int, tuple[Slot, dict[str, Any]]] = field(default_factory=dict)
    tag: dict[str, Any] | None = None
    """The snapshots' lineage tag (the same on every rank): what the attempt that resumes continues
    (``Checkpointer.start_attempt(step, from_memory=True, tag=...)``)."""
    folder: str | None = None
    """The folder the step was saved for (``save(..., folder=)``), when one was named."""

    @classmethod
    def open(cls, ck: Any, choice: Choice, found: list[Snapshot]) -> Sources | None:
        """Map and verify the snapshots this rank serves (collective); ``None`` on every rank when one
        of them, on any rank, is gone or fails its checksums (the caller reads storage instead)."""
        sources, ok = cls(choice), True
        for snap in found:
            if (snap.world_size, snap.step) != (choice.world_size, choice.step):
                continue
            if choice.owners.get(snap.rank) != ck.rank or snap.rank in sources.slots:
                continue
            slot = Slot.attach(snap.path)  # verified on the mapping the reads then use
            status = check_attached(slot) if slot is not None else {"status": "empty"}
            header = slot.read_header() if slot is not None and status["status"] == "ok" else None
            if header is None or (header.step, header.seq) != (snap.step, snap.seq):
                logger.warning("[RANK %d] the snapshot of old rank %d (step %d) in %s did not verify (%s); "
                               "loading from storage", ck.rank, snap.rank, snap.step, snap.path,
                               status.get("detail") or status["status"])
                if slot is not None:
                    slot.close()
                ok = False
                break
            sources.slots[snap.rank] = (slot, slot.read_metadata(header))
        tag = next((meta.get("tag") for _, meta in sources.slots.values() if meta.get("tag")), None)
        folder = next((meta.get("persist_target", {}).get("layout", {}).get("folder")
                       for _, meta in sources.slots.values()), None)
        verified = [[_HOST, snap.path, snap.seq] for snap in found if snap.rank in sources.slots
                    and (snap.world_size, snap.step) == (choice.world_size, choice.step)]
        views = collectives.all_gather_object([ok, tag, folder, verified], ck.world_size, ck.process_group)
        if not all(v[0] for v in views):
            sources.close()
            return None
        sources.tag = next((v[1] for v in views if v[1]), None)
        sources.folder = next((v[2] for v in views if v[2]), None)
        sources._map_local(found, {tuple(key) for v in views for key in v[3]})
        return sources

    def _map_local(self, found: list[Snapshot], verified: set[tuple[str, str, int]]) -> None:
        """Map the snapshots of the chosen step on this node that another rank of the node verified."""
        for snap in found:
            if (snap.world_size, snap.step) != (self.choice.world_size, self.choice.step):
                continue
            if snap.rank in self.slots or snap.rank in self.local or (_HOST, snap.path, snap.seq) not in verified:
                continue
            slot = Slot.attach(snap.path)
            header = slot.read_header() if slot is not None else None
            if header is None or (header.step, header.seq) != (snap.step, snap.seq):  # replaced since: not read
                if slot is not None:
                    slot.close()
                continue
            self.local[snap.rank] = (slot, slot.read_metadata(header))

    def readable(self) -> dict[int, tuple[Slot, dict[str, Any]]]:
        """Every old rank's snapshot this rank reads in place: the ones it serves and its node's others."""
        return {**self.local, **self.slots}

    def close(self) -> None:
        for slot, _ in [*self.slots.values(), *self.local.values()]:
            slot.close()
        self.slots, self.local = {}, {}
