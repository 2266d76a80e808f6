"""flashckpt-integrations: near-free checkpointing for PyTorch training.

``import flashckpt_integrations`` needs torch only (and imports it with the first use of
``Checkpointer``); framework adapters live in
``flashckpt_integrations.adapters`` and import their framework themselves.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from .config import BusyPolicy, CheckpointerConfig
from .core.layout import Layout
from .core.results import LoadResult, PersistResult, SaveResult, SaveStatus
from .core.retention import RetentionPolicy
from .core.storage import Storage, register_storage
from .core.writing import Codec
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FlashCkptError,
    IncompleteCheckpointError,
    LayoutMismatchError,
    MissingDependencyError,
    SaverProcessError,
    SharedMemoryError,
    StorageError,
)
from .stop_signal import StopSignal

# Imported on first use (they import torch): the saver imports this package and starts without torch.
_LAZY = {"Checkpointer": ".core.checkpointer", "FileSpec": ".core.state"}

if TYPE_CHECKING:
    from .core.checkpointer import Checkpointer
    from .core.state import FileSpec


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BusyPolicy",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CheckpointerConfig",
    "Codec",
    "CorruptCheckpointError",
    "FileSpec",
    "FlashCkptError",
    "IncompleteCheckpointError",
    "Layout",
    "LayoutMismatchError",
    "LoadResult",
    "MissingDependencyError",
    "PersistResult",
    "RetentionPolicy",
    "SaveResult",
    "SaveStatus",
    "SaverProcessError",
    "SharedMemoryError",
    "StopSignal",
    "Storage",
    "StorageError",
    "__version__",
    "register_storage",
]
