"""Names shared by the saver and its clients (kept apart so that neither imports the other)."""

import glob
import json
import logging
import os

logger = logging.getLogger(__name__)

SOCKET_NAME = "saver.sock"
LOCK_NAME = "saver.lock"
LOG_NAME = "saver.log"
SPAWN_LOCK_NAME = "spawn.lock"
SLOTS_FILE = "slots-r{rank}.json"
"""Written by each rank: the paths of its slots, so that a saver finds snapshots it was never told of."""


def read_slot_records(run_dir: str, *, warn: bool = False) -> dict[int, list[str]]:
    """The slot files each rank of the node recorded in the saver's run directory (:data:`SLOTS_FILE`),
    by rank; an unreadable record is skipped (``warn``: with a WARNING saying which)."""
    found: dict[int, list[str]] = {}
    for record in sorted(glob.glob(os.path.join(run_dir, SLOTS_FILE.format(rank="*")))):
        try:
            with open(record) as f:
                data = json.load(f)
            found[int(data["rank"])] = [str(p) for p in data.get("slots", [])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if warn:
                logger.warning("ignoring unreadable slot record %s: %s", record, exc)
    return found


class TrainerOp:
    """The operations a rank sends its node's saver: one JSON object a line on the saver's socket,
    each with ``op`` and an ``id`` that its answer (``{"id", "ok", ...}``) carries back."""

    HELLO = "hello"
    PING = "ping"
    ATTACH = "attach"
    PERSIST = "persist"
    CLOSE = "close"
    REPLICA_PUSH = "replica_push"
    REPLICA_INVENTORY = "replica_inventory"
    REPLICA_FETCH = "replica_fetch"
    STOPPING = "stopping"


TRAINER_OPS = {
    TrainerOp.HELLO: "a rank connects (rank, writer, replication settings); the saver sums and persists what "
                     "an earlier process of the rank left behind, then answers (pid, replica_pushes)",
    TrainerOp.PING: "is the saver alive (pid)",
    TrainerOp.ATTACH: "map and pre-fault a new or grown slot ahead of its first persist",
    TrainerOp.PERSIST: "persist one sealed snapshot (the request kept in the slot's metadata); answered once "
                       "the rank's files are durable, rank 0's once the step is committed",
    TrainerOp.CLOSE: "the rank leaves (clean: its slots are gone, nothing of it is left to recover)",
    TrainerOp.REPLICA_PUSH: "offer a sealed snapshot to the peers (per-snapshot copies; answered at once)",
    TrainerOp.REPLICA_INVENTORY: "which replicas of this rank the job's savers hold",
    TrainerOp.REPLICA_FETCH: "copy one replica from the saver holding it into one of the rank's slots",
    TrainerOp.STOPPING: "the rank got SIGTERM (on a connection of its own; local_world_size: the node's ranks): "
                        "unless a rank of the node failed just before or sent no notice with it, the saver "
                        "persists the newest snapshot every local rank holds, then answers (drained, reason)",
}
"""Every trainer -> saver operation and what it asks (the saver's dispatcher answers any other with an error)."""


class PeerOp:
    """The operations between the savers of a job (peer replication, :mod:`.replication`): one JSON
    message each on a connection authenticated by :func:`.replication.peers.connect`, answered on it
    (raw bytes follow a message where it announces them)."""

    PUSH = "push"
    INVENTORY = "inventory"
    FETCH = "fetch"
    ROUND_HELD = "round_held"
    ROUND_SNAP = "round_snap"
    ROUND_SEND = "round_send"
    ROUND_KEPT = "round_kept"


PEER_OPS = {
    PeerOp.PUSH: "a copy of one sealed snapshot for the receiver's replica store: announced, accepted or skipped "
                 "(with the reason), streamed (only the pieces the receiver lacks), confirmed intact by the sender",
    PeerOp.INVENTORY: "what the saver holds: the replicas in its store and its own ranks' complete snapshots",
    PeerOp.FETCH: "stream one complete replica back, with the crc32 taken when it was made (a restore)",
    PeerOp.ROUND_HELD: "(round leader) the steps >= after that every rank of the node holds, and those being persisted",
    PeerOp.ROUND_SNAP: "(round leader) copy the node's ranks' snapshots of one step into its replica store",
    PeerOp.ROUND_SEND: "(round leader) copy those kept copies to the node's placement targets",
    PeerOp.ROUND_KEPT: "(round leader) the job's new kept step, which no store write overwrites until a newer one",
}
"""Every saver <-> saver operation and what it asks (a saver answers any other with an error)."""
ROUND_OPS = (PeerOp.ROUND_HELD, PeerOp.ROUND_SNAP, PeerOp.ROUND_SEND, PeerOp.ROUND_KEPT)
"""The peer operations of a replication round (the leader's questions)."""
