"""Retention: which committed steps to delete after a commit.

The policy works only from the list of committed steps on storage, so a restarted saver
decides exactly as the one before it. It never selects the newest committed step, and the
caller never passes steps that are in flight (not yet committed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed steps, and every step divisible by ``keep_every``.

    With neither set, nothing is deleted. With only ``keep_every``, the newest step is kept too.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(
                f"keep_last={self.keep_last}: at least the newest committed checkpoint must be kept; "
                "use keep_last >= 1, or None to keep everything"
            )
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every={self.keep_every} must be a positive step interval or None")

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None

    def select_deletions(self, committed: list[int], key: Callable[[int], Any] | None = None) -> list[int]:
        """The committed steps to delete. ``key`` orders them oldest to newest (default: by step);
        the committer orders a later attempt's steps after an earlier attempt's."""
        if not self.enabled or not committed:
            return []
        steps = sorted(set(committed), key=key)
        keep = {steps[-1]}
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        return [s for s in steps if s not in keep]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
