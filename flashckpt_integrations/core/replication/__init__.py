"""Peer replicas of memory snapshots, in the saver: copies to other nodes, kept, and fetched back.

A node's saver copies its ranks' sealed snapshots to the savers of the next ``replicas`` nodes
(:func:`placement`), which keep them in replica slots (:class:`ReplicaStore`). A replacement
node's ranks then restore from those copies instead of storage (the rank's side is
:mod:`.rank`). Everything here is best effort and off the training path: a save
never waits for a copy, a persist never waits for a peer, a slow or dead peer only delays or drops
copies (logged, and shown by ``flashckpt ls``). No torch here: the saver imports this package.

Call order (one :class:`Replication` per saver, made by the saver at its start):

1. A rank's ``hello`` carries its replication settings: :meth:`Replication.configure`. The first
   opens the store, reads the job secret, listens on TCP and publishes the saver's
   :class:`~.peers.PeerRecord`, then picks the copy policy (:func:`.service.copy_policy`: rounds,
   or eager pushes with ``$FLASHCKPT_REPLICA_ROUNDS=0``) and starts the :class:`~.server.PeerServer`
   and the policy. Later hellos only follow a change of node or replica count
   (:meth:`.policy.CopyPolicy.retarget`). The hello's answer says whether the ranks should offer
   each sealed snapshot (:meth:`Replication.wants_pushes`).
2. Copies, as the policy decides (:class:`.policy.CopyPolicy`):
   - rounds (:mod:`.rounds`, the default): node 0's saver leads job-wide rounds (``round_held``,
     ``round_snap``, ``round_send``, ``round_kept`` to every saver) that copy one step of every
     rank into its own node's store and from there to its peers, and keep it;
   - eager (:mod:`.eager`): each ``replica_push`` from a rank (:meth:`Replication.handle` ->
     :meth:`Replication.offer`) queues the snapshot for one sender thread per target node.
   Either way a copy is a ``push`` (:func:`.transfer.push_copy` -> :class:`.transfer.PushReceiver`
   on the target, which takes the pieces its own ranks hold from their slots, :mod:`.reuse`).
3. A restore on a replacement node: its ranks ask ``replica_inventory`` (their saver surveys every
   published saver with ``inventory``, :func:`survey`) and ``replica_fetch`` (their saver fetches
   the replica from its holder with ``fetch`` into the rank's own slot, :mod:`.transfer`).
4. :meth:`Replication.close` stops the policy and the listener; on a clean end of the job it
   removes the replica slots, the peer record and the status file (:data:`STATUS_FILE`).

The saver <-> saver operations and what each asks are listed in
:data:`flashckpt_integrations.core.protocol.PEER_OPS`; every connection between savers is
authenticated with the job's secret (:mod:`.peers`).

Modules, each importing only modules listed before it: :mod:`.stream` (a slot's bytes on a socket, with their
crc32), :mod:`.store` (replica slots), :mod:`.peers` (records, secret, handshake, channels),
:mod:`.local` (this node's own ranks' slots), :mod:`.reuse` (data-parallel pieces), :mod:`.status`
(the status file), :mod:`.pacing` (the duty and CPU knobs), :mod:`.transfer` (push, fetch,
inventory), :mod:`.policy` (:class:`~.policy.CopyPolicy`), :mod:`.rounds` and :mod:`.eager` (the
two policies), :mod:`.server` (the listener), :mod:`.service` (:class:`Replication`).
"""

from . import peers
from .peers import placement
from .service import SURVEY_CACHE_S, Replication
from .status import STATUS_FILE
from .store import ReplicaStore, list_replicas, replica_path, replica_paths, verify
from .stream import CHUNK
from .transfer import survey

__all__ = [
    "CHUNK",
    "STATUS_FILE",
    "SURVEY_CACHE_S",
    "ReplicaStore",
    "Replication",
    "list_replicas",
    "peers",
    "placement",
    "replica_path",
    "replica_paths",
    "survey",
    "verify",
]
