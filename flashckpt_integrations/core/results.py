"""What ``save``, ``wait`` and ``load`` return."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SaveStatus(str, Enum):
    IN_MEMORY = "in_memory"
    """The snapshot is complete in shared memory; nothing is written to storage."""
    PERSISTING = "persisting"
    """The snapshot is in memory and the saver is persisting it; ``wait()`` for the commit."""
    SKIPPED = "skipped"
    """Nothing was saved; ``reason`` says why."""
    FAILED = "failed"
    """The save could not happen; ``reason`` says why. Earlier checkpoints are intact."""


@dataclass
class PersistResult:
    step: int
    committed: bool
    error: str | None = None


@dataclass
class SaveResult:
    """What ``save`` did. ``blocking_s`` is how long the caller was held."""

    step: int
    status: SaveStatus
    reason: str | None = None
    blocking_s: float = 0.0
    sealed: Future | None = field(default=None, repr=False)
    """Set by the checkpointer: resolves once the snapshot is copied and sealed (an overlapped
    save's copy, a first save's seal after its attempt's record)."""
    durable: Future | None = field(default=None, repr=False)
    """Set by the checkpointer: resolves with the saver's answer once this rank's files are durable."""
    poll_commit: Callable[[int, float | None], PersistResult] | None = field(default=None, repr=False)
    """Set by the checkpointer: watches storage for the commit once the files are durable."""
    _outcome: PersistResult | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status in (SaveStatus.IN_MEMORY, SaveStatus.PERSISTING)

    def wait(self, timeout: float | None = None) -> PersistResult:
        """Wait until the snapshot is in memory and, when persisting, committed or failed.

        An overlapped save whose copy fails turns ``FAILED`` (with the reason) once it failed;
        this then returns ``committed=False`` with that reason.
        """
        if self._outcome is not None:
            return self._outcome
        if not self.ok:
            return PersistResult(self.step, False, self.reason)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.sealed is not None:
            self.sealed.result(timeout)
            if not self.ok:  # the overlapped copy failed: ``status``/``reason`` say so now
                return PersistResult(self.step, False, self.reason)
        if self.durable is None:
            return PersistResult(self.step, False, None)
        answer = self.durable.result(_remaining(deadline))
        if answer.get("ok"):
            self._outcome = self.poll_commit(self.step, _remaining(deadline))
        else:
            self._outcome = PersistResult(self.step, False, answer.get("error"))
        return self._outcome

    def durable_done(self) -> bool:
        """Whether this rank's files are durable (or failed): nothing is left to wait for here."""
        return self.durable is None or self.durable.done()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@dataclass
class LoadResult:
    step: int
    source: str
    """``"memory"`` or ``"storage"``."""
    files: dict[str, Any]
    tiers: dict[int, str] = field(default_factory=dict)
    """Which tier served each rank: ``"memory"`` (its own slot), ``"replica"`` (a peer's copy,
    fetched into its slot) or ``"storage"``; every byte verified either way."""
    fallbacks: list[str] = field(default_factory=list)
    """What failed verification before this step was restored (empty when nothing did)."""

    @property
    def state(self) -> Any:
        """The object saved with ``save(step, state)``."""
        for path, obj in self.files.items():
            if path.startswith("rank-") and path.endswith(".pt"):
                return obj
        raise KeyError("this checkpoint was saved with files=..., read LoadResult.files")
