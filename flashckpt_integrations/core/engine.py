"""Where ``Checkpointer`` has always been imported from; it lives in :mod:`.checkpointer`."""

from .checkpointer import ERROR_EXIT_WAIT_S, STATE_FILE, Checkpointer
from .results import LoadResult, PersistResult, SaveResult, SaveStatus

__all__ = ["ERROR_EXIT_WAIT_S", "STATE_FILE", "Checkpointer", "LoadResult", "PersistResult", "SaveResult",
           "SaveStatus"]
