"""The trainer's side of flash checkpoints: :class:`Checkpointer` and the parts it is made of.

Call order: ``Checkpointer(dir)`` -> optionally ``prepare(state)`` -> ``save(step, state)``
each time a checkpoint is due -> ``load()`` after a (re)start -> ``wait()`` where the caller
needs durability -> ``close()`` at the end of the job (or ``with Checkpointer(...)``).

``save`` copies the state into one of the rank's two shared-memory slots and, when asked to
persist, tells the node's saver, which writes the files and takes part in the commit. ``load``
restores from memory when every rank holds the same complete snapshot that is at least as new
as the newest commit (decided collectively), otherwise from the newest commit on storage.

The parts, each an object with its own state, made and wired by ``Checkpointer`` (:mod:`.api`):

- :mod:`.slots`: ``RankSlots``, the rank's slots (which one a save takes, their lifetime, the
  held slot, pinning, sequence numbers);
- :mod:`.attempt`: ``Attempt``, what this attempt may load (its lineage, decided once);
- :mod:`.requests`: ``PersistRequests``, persist requests to the node's saver and their commits;
- :mod:`.saving`: ``SavePath``, plan, copy, seal, hand over (``PendingSave`` between them);
- :mod:`.direct`: a persisting save written from the training process when /dev/shm is too small;
- :mod:`.loading`: ``LoadPath``, choosing, verifying and restoring a step, falling back together.
"""

from .api import Checkpointer
from .requests import ERROR_EXIT_WAIT_S
from .saving import STATE_FILE

__all__ = ["ERROR_EXIT_WAIT_S", "STATE_FILE", "Checkpointer"]
