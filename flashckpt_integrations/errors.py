"""Exception hierarchy of flashckpt-integrations.

Every message says what was found, what was expected and what to do about it.
"""

from __future__ import annotations


class FlashCkptError(Exception):
    """Base class of every error raised by this package."""


class CheckpointNotFoundError(FlashCkptError):
    """No committed checkpoint (or no in-memory snapshot) matches the request."""


class IncompleteCheckpointError(FlashCkptError):
    """A checkpoint exists but is not complete: torn slot, missing files or no commit."""


class CorruptCheckpointError(IncompleteCheckpointError):
    """A header, metadata block or file failed its integrity check."""


class SaverProcessError(FlashCkptError):
    """The node's saver process could not be started, reached or kept alive."""


class NodeCheckError(FlashCkptError):
    """The check run before training found failed or slow nodes, or could not run at all.

    ``report`` holds the parsed ``NodeCheckReport`` when the check got as far as writing one.
    """

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class LayoutMismatchError(FlashCkptError):
    """Saved state does not match the layout (keys, shapes, parallel sizes) it is loaded into."""


class MissingDependencyError(FlashCkptError, ImportError):
    """An optional framework or backend is not installed."""


class SharedMemoryError(FlashCkptError):
    """Shared memory could not be created, grown or attached."""


class StorageError(FlashCkptError):
    """A storage backend failed to write, read, list or remove a path."""


def missing_dependency(package: str, extra: str) -> MissingDependencyError:
    """Build the error raised when ``package`` is needed but not importable."""
    return MissingDependencyError(
        f"{package} is required for this feature but is not installed. "
        f"Install it with: pip install 'flashckpt-integrations[{extra}]'"
    )
