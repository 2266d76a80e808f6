"""What a copy policy is: when a saver copies its ranks' snapshots to its peers, and which it keeps.

Two policies implement :class:`CopyPolicy`: :class:`~.rounds.Rounds` (the default: job-wide rounds
that keep one step on every node) and :class:`~.eager.Eager` (each rank's newest sealed snapshot to
every placement target on its own, ``$FLASHCKPT_REPLICA_ROUNDS=0``). :func:`.service.copy_policy`
picks one when replication starts; :class:`~.service.Replication` and :class:`~.server.PeerServer`
call it only through this interface. A policy is given the saver's :class:`ReplicaSettings` and a
:class:`PolicyContext`, and copies with :mod:`.transfer`. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .peers import PeerDialer, placement
from .status import StatusFile
from .store import ReplicaStore


@dataclass(frozen=True)
class ReplicaSettings:
    """What a rank tells its saver about replication (in its hello)."""

    job: str
    node_rank: int
    nnodes: int
    replicas: int
    shm_dir: str
    addr: str
    node_id: str
    target: dict[str, Any]
    """``root``, ``storage_options``, ``storage_factory``: how to open the checkpoint storage."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaSettings:
        settings = cls(str(data["job"]), int(data["node_rank"]), int(data["nnodes"]), int(data["replicas"]),
                       str(data["shm_dir"]), str(data["addr"]), str(data.get("node_id", "")), dict(data["target"]))
        if settings.replicas not in (1, 2) or not 0 <= settings.node_rank < max(settings.nnodes, 1):
            raise ValueError(f"replicas={settings.replicas} (1 or 2), node rank {settings.node_rank} of "
                             f"{settings.nnodes} nodes")
        return settings

    def targets(self) -> list[int]:
        """The nodes that hold the replicas of this node's ranks (:func:`.peers.placement`)."""
        return placement(self.node_rank, self.nnodes, self.replicas)


@dataclass(frozen=True)
class PolicyContext:
    """What a copy policy works with, besides the settings: this saver's run directory (its
    ranks' slot records), its replica store, its way to the peers and its status file."""

    run_dir: str
    store: ReplicaStore
    dialer: PeerDialer
    status: StatusFile


@runtime_checkable
class CopyPolicy(Protocol):
    """When a saver copies its ranks' snapshots to its peers (see the module docstring).

    Call order, on one saver:

    1. Made with the context and the settings once the store, the listener and the peer record
       are up; :meth:`start`.
    2. :meth:`retarget` whenever a hello changes the node or replica count.
    3. :meth:`offer` for each sealed snapshot a rank announces (``replica_push``); the ranks
       announce them only where :attr:`wants_pushes`.
    4. :meth:`handles` / :meth:`handle` for each peer operation that no copy serves (the
       policy's own, e.g. a round's questions).
    5. :meth:`kept` before each write into the replica store: the step whose copies it must not
       overwrite.
    6. :meth:`close` when the saver stops replicating.
    """

    wants_pushes: bool
    """Whether the ranks offer each sealed snapshot (``replica_push``) to their saver."""

    def start(self) -> None:
        """Start what runs on its own (a thread), if anything."""

    def retarget(self, settings: ReplicaSettings) -> None:
        """Follow a new node or replica count."""

    def offer(self, note: dict[str, Any]) -> None:
        """A rank's sealed snapshot (``rank``, ``slot``, ``step``, ``seq``): copy it, or not."""

    def handles(self, op: str) -> bool:
        """Whether the peer operation ``op`` is one of the policy's own."""

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Serve one of the policy's own peer operations; the answer."""

    def kept(self) -> int | None:
        """The step whose copies no store write may overwrite (None: any)."""

    def close(self) -> None:
        """Stop; nothing is copied afterwards."""
