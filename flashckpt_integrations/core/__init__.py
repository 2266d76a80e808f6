"""The framework-free core: snapshots, slots, the saver, storage, commit and retention.

Public names are re-exported from the package root; import submodules for the rest.

Where each module runs:

- the training process: ``checkpointer`` (a package: ``Checkpointer`` and its parts, the rank's
  ``slots``, its ``attempt``, persist ``requests``, the ``saving`` and ``loading`` paths and
  ``direct``, a save straight to storage when /dev/shm is too small; ``engine`` is its old import
  path), ``state`` (plans and copies), ``restore``, ``codecs`` (reading files back),
  ``replication.rank`` (the rank's side of peer replicas), ``client`` (the socket to the saver),
  ``stop_notice`` (a rank's SIGTERM asks the saver to persist first), ``collectives``; ``rescue``
  runs in the CLI and the launcher (``flashckpt persist``);
- the saver process (``python -m flashckpt_integrations.core.saver``, no torch): ``saver`` (the
  process: socket, ops, recovery, exit), ``preemption`` (what it does on SIGTERM),
  ``replication`` (peer replicas, a package; the CLI and ``rescue`` read its replica slots too);
- both: ``persister`` (persist, commit, retention), ``commit``, ``lineage``, ``layout``,
  ``storage``, ``writing``, ``torchzip``, ``shm_buffer`` (``Slot``), ``verify``, ``retention``,
  ``protocol`` (names, and the table of every operation on the two wires: ``TRAINER_OPS``,
  ``PEER_OPS``), ``results``.
"""
