"""A rank's side of peer replicas: turning them on, announcing sealed snapshots, restoring from a peer.

The savers do the copying (:mod:`.service`); a rank only tells its saver what to do. Call
order, from the :class:`~flashckpt_integrations.Checkpointer`:

1. ``ReplicaHook(checkpointer)`` in its constructor, before the saver client: the replica count
   (``$FLASHCKPT_REPLICAS``, else ``CheckpointerConfig.replicas``), this node's rank and the node
   count (torchrun's ``GROUP_RANK``/``GROUP_WORLD_SIZE``, else ``LOCAL_WORLD_SIZE``), and
   :meth:`~ReplicaHook.hello`, the settings every hello hands the saver.
2. :meth:`~ReplicaHook.sealed` after each sealed snapshot: a notification sent from the hook's own
   thread (the save does not wait for it, nor for the copy).
3. In ``load()``, collectively: :meth:`~ReplicaHook.prepare_load` before the ranks first agree (every
   node's saver is up and published once they have), then :meth:`~ReplicaHook.resolve`: when the
   step to load is not in every rank's memory, each rank offers the steps it holds locally or a
   peer holds for it, the ranks agree on the newest common one, and those without it fetch it into
   their own slot, from which they restore as from any memory snapshot. If any fetch fails, every
   rank falls back to what the ranks hold themselves (else storage).
4. :meth:`~ReplicaHook.restored` after a memory restore (the restored snapshot is offered to the
   peers, so a replaced peer gets its copy before the next save), :meth:`~ReplicaHook.close`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ... import knobs
from ...config import CheckpointerConfig
from ...errors import FlashCkptError
from .. import collectives
from ..client import SaverClient
from ..protocol import TrainerOp
from ..shm_buffer import Slot, SlotState
from . import peers


class RankInfo(Protocol):
    """What the hook reads of its rank's checkpointer."""

    config: CheckpointerConfig
    rank: int
    world_size: int
    process_group: Any
    job_key: str
    slot_paths: list[str]
    run_dir: str
    url: str


class RankSlots(Protocol):
    """What a fetch needs of the rank's slots (``checkpointer.slots.RankSlots``)."""

    lock: Any

    def choose(self, hold: int = 0) -> tuple[int | None, str | None]: ...
    def forget(self, index: int) -> None: ...
    def path(self, index: int) -> str: ...
    def renumber(self) -> None: ...

logger = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 60.0


def replica_count(configured: int) -> int:
    """``$FLASHCKPT_REPLICAS`` when set, else the configured count (0, 1 or 2)."""
    value = knobs.get(knobs.REPLICAS)
    if value is None:
        return configured
    if value not in ("0", "1", "2"):
        raise ValueError(f"{knobs.REPLICAS}={value!r} must be 0, 1 or 2 (peer copies of each snapshot); "
                         "fix or unset it")
    return int(value)


def node_topology(rank: int, world_size: int) -> tuple[int, int]:
    """``(node rank, node count)`` of this rank: torchrun's, else from ``LOCAL_WORLD_SIZE``."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    node_rank = int(os.environ.get("GROUP_RANK") or rank // local)
    nnodes = int(os.environ.get("GROUP_WORLD_SIZE") or -(-world_size // local))
    return node_rank, nnodes


class ReplicaHook:
    """Replication as one rank sees it (see the module docstring)."""

    def __init__(self, ck: RankInfo) -> None:
        self.ck = ck
        self.replicas = replica_count(ck.config.replicas)
        self.node_rank, self.nnodes = node_topology(ck.rank, ck.world_size)
        self.enabled = self.replicas > 0 and self.nnodes > 1
        self.fetched: dict[str, Any] | None = None
        """The newest restore from a peer: step, the node it came from, bytes, seconds."""
        if self.replicas > 0 and self.nnodes <= 1 and ck.rank == 0:
            logger.info("[RANK 0] replicas=%d asked for, but the job runs on one node: no peer to hold them",
                        self.replicas)
        self._notify = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-replica") if self.enabled else None
        self.client: SaverClient | None = None
        self._slots: RankSlots | None = None
        self._view: Callable[[], Any] | None = None
        self._snapshots: Callable[[], dict[int, Any]] | None = None

    def bind(self, *, client: SaverClient, slots: RankSlots, view: Callable[[], Any],
             snapshots: Callable[[], dict[int, Any]]) -> None:
        """The rank's parts this hook works through, once the checkpointer has made them: its saver
        connection, its slots, its attempt's view and its memory snapshots (by step)."""
        self.client, self._slots, self._view, self._snapshots = client, slots, view, snapshots

    def hello(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        ck = self.ck
        return {"replication": {
            "job": ck.job_key, "node_rank": self.node_rank, "nnodes": self.nnodes, "replicas": self.replicas,
            "shm_dir": os.path.dirname(ck.slot_paths[0]), "addr": peers.local_address(os.environ.get("MASTER_ADDR")),
            "node_id": os.path.basename(ck.run_dir),
            "target": {"root": ck.url, "storage_options": ck.config.storage_options,
                       "storage_factory": ck.config.storage_factory},
        }}

    # --- saving ----------------------------------------------------------------------------

    def sealed(self, path: str, step: int, seq: int) -> None:
        """Offer a sealed snapshot to the peers (returns at once; not when the saver runs rounds)."""
        if self._notify is not None and self.client.replica_pushes:
            with contextlib.suppress(RuntimeError):  # the interpreter is exiting: no more offers
                self._notify.submit(self._send, {"op": TrainerOp.REPLICA_PUSH, "rank": self.ck.rank, "slot": path,
                                                 "step": step, "seq": seq})

    def restored(self, slot: Slot) -> None:
        header = slot.read_header() if self.enabled else None
        if header is not None and header.state is SlotState.COMPLETE:
            self.sealed(slot.path, header.step, header.seq)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.client.connect()
            self.client.request(message)  # answered at once; nothing waits for the answer
        except FlashCkptError as exc:
            logger.debug("[RANK %d] could not offer step %s to the peers: %s", self.ck.rank, message["step"], exc)

    def close(self) -> None:
        if self._notify is not None:
            self._notify.shutdown(wait=True)

    # --- loading ---------------------------------------------------------------------------

    def prepare_load(self) -> None:
        """Make sure this node's saver is up and published before the ranks first agree in load()."""
        if not self.enabled:
            return
        try:
            self.client.connect()
        except FlashCkptError as exc:
            logger.warning("[RANK %d] the saver is unavailable, so are peer replicas: %s", self.ck.rank, exc)

    def resolve(self, memory: dict[int, Any], views: list[Any], in_every_rank: set[int],
                newest_commit: int | None, step: int | None) -> tuple[dict[int, Any], set[int]]:
        """``(memory, steps every rank holds)`` once peers' replicas are counted (collective).

        Every rank takes the same branches: they depend only on what the ranks gathered.
        """
        union = set().union(*(set(v[0]) for v in views))
        target = step if step is not None else max(union, default=None)
        if (not self.enabled or target is None or target in in_every_rank
                or (step is None and newest_commit is not None and target < newest_commit)):
            return memory, in_every_rank
        offers = self._offers()
        gathered = collectives.all_gather_object(sorted(set(memory) | set(offers)), self.ck.world_size,
                                                 self.ck.process_group)
        common = set.intersection(*(set(g) for g in gathered))
        eligible = ([s for s in common if newest_commit is None or s >= newest_commit] if step is None
                    else [step] if step in common else [])
        chosen = max(eligible, default=None)
        if chosen is None or chosen in in_every_rank:
            return memory, in_every_rank
        error = None if chosen in memory else self._fetch(offers[chosen])
        errors = collectives.all_gather_object(error, self.ck.world_size, self.ck.process_group)
        failed = {rank: e for rank, e in enumerate(errors) if e}
        if not failed:
            return self._snapshots(), {chosen}
        if self.ck.rank == 0:
            logger.warning("[RANK 0] step %d is not restored from peer memory: %s", chosen,
                           "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
        memory = self._snapshots()  # a failed fetch may have taken a slot: agree again
        views = collectives.all_gather_object(sorted(memory), self.ck.world_size, self.ck.process_group)
        return memory, set.intersection(*(set(v) for v in views))

    def _offers(self) -> dict[int, dict[str, Any]]:
        """The steps of this rank that the job's savers hold as replicas, this attempt may load."""
        ck = self.ck
        try:
            self.client.connect()
            request = {"op": TrainerOp.REPLICA_INVENTORY, "rank": ck.rank}
            answer = self.client.request(request).result(INVENTORY_TIMEOUT_S)
        except Exception as exc:
            logger.warning("[RANK %d] could not ask the peers for replicas: %s", ck.rank, exc)
            return {}
        if not answer.get("ok"):
            logger.warning("[RANK %d] could not ask the peers for replicas: %s", ck.rank, answer.get("error"))
            return {}
        view = self._view()
        offers: dict[int, dict[str, Any]] = {}
        for entry in answer.get("replicas", []):
            step = int(entry["step"])
            if entry.get("world_size") != ck.world_size or not view.accepts(entry.get("tag"), step):
                continue
            if step not in offers or offers[step]["seq"] < entry["seq"]:
                offers[step] = entry
        return offers

    def _fetch(self, entry: dict[str, Any]) -> str | None:
        """Copy a peer's replica into one of this rank's slots; the reason when it did not work."""
        ck, slots = self.ck, self._slots
        with slots.lock:
            index, reason = slots.choose()
            if index is None:
                return reason
            slots.forget(index)  # the saver may grow the file: map it afresh afterwards
            request = {"op": TrainerOp.REPLICA_FETCH, "rank": ck.rank, "step": entry["step"], "seq": entry["seq"],
                       "holder": entry["holder"], "slot": slots.path(index)}
            try:
                self.client.connect()
                answer = self.client.request(request).result(ck.config.commit_timeout_s)
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            slots.renumber()  # the next save must count as newer than the copy
            if not answer.get("ok"):
                return answer.get("error") or "the fetch failed"
            if entry["step"] not in self._snapshots():
                return f"the fetched copy of step {entry['step']} is not loadable"
        self.fetched = {"step": entry["step"], "from_node": answer.get("from_node"), "bytes": answer.get("bytes"),
                        "seconds": answer.get("seconds")}
        logger.info("[RANK %d] fetched step %d from node %s's memory (%.1f MiB in %.2fs)", ck.rank, entry["step"],
                    answer.get("from_node"), (answer.get("bytes") or 0) / 2**20, answer.get("seconds") or 0.0)
        return None
