"""The framework-free core: snapshots, slots, the saver, storage, commit and retention.

Public names are re-exported from the package root; import submodules for the rest.

Where each module runs:

- the training process: ``engine`` (``Checkpointer``: save), ``loading`` (its load path),
  ``state`` (plans and copies), ``restore``, ``codecs`` (reading files back), ``direct`` (a save
  straight to storage when /dev/shm is too small), ``replica_restore`` (the rank's side of peer
  replicas), ``client`` (the socket to the saver), ``collectives``; ``rescue`` runs in the CLI
  and the launcher (``flashckpt persist``);
- the saver process (``python -m flashckpt_integrations.core.saver``, no torch): ``saver`` (the
  process: socket, ops, recovery, exit), ``preemption`` (what it does on SIGTERM),
  ``replication``, ``replica_rounds``, ``replica_reuse``, ``peers``;
- both: ``persister`` (persist, commit, retention), ``commit``, ``lineage``, ``layout``,
  ``storage``, ``writing``, ``torchzip``, ``shm_buffer`` (``Slot``), ``replica_slots``,
  ``verify``, ``retention``, ``protocol``, ``results``.
"""
