"""flashckpt-integrations: near-free checkpointing for PyTorch training.

``import flashckpt_integrations`` needs torch only; framework adapters live in
``flashckpt_integrations.adapters`` and import their framework themselves.
"""

__version__ = "0.1.0"

from .config import BusyPolicy, CheckpointerConfig
from .core.engine import Checkpointer
from .core.layout import Layout
from .core.results import LoadResult, PersistResult, SaveResult, SaveStatus
from .core.retention import RetentionPolicy
from .core.state import Codec, FileSpec
from .core.storage import Storage, register_storage
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
    "Storage",
    "StorageError",
    "__version__",
    "register_storage",
]
