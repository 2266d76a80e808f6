"""Typed configuration of the checkpointer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .core.layout import Layout
from .core.retention import RetentionPolicy


class BusyPolicy(str, Enum):
    """What a save does when every slot of the rank is still being persisted."""

    WAIT = "wait"
    """Block until the older persist finishes (bounded by ``busy_timeout_s``, then skip)."""
    SKIP = "skip"
    """Return at once with ``SaveStatus.SKIPPED`` and the reason."""


@dataclass(kw_only=True)
class CheckpointerConfig:
    """Everything a :class:`~flashckpt_integrations.Checkpointer` can be told."""

    job_id: str | None = None
    """Names the job's slots and saver. Default: ``$FLASHCKPT_JOB_ID``, else the checkpoint
    directory, so a relaunch of the same job finds its memory and two jobs never collide."""
    node_id: str | None = None
    """Names the node's saver. Default: ``$FLASHCKPT_NODE_ID``, else host name and node rank."""
    layout: Layout = field(default_factory=Layout)
    """Step directory, tracker and staging (adapters set their framework's names)."""
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    """Which committed steps to delete after each commit (default: keep all)."""
    async_snapshot: bool = False
    """Overlap the memory copy with training: ``save`` returns once the copy has started and
    the next optimizer step (of the optimizers given to the checkpointer) waits for it. The
    state's tensors must not change until then. Default: synchronous copy."""
    stream_persist: bool = False
    """Hand a persisting save to the saver before its memory copy starts, so the saver writes
    each tensor as soon as it is in place. Shortens call-to-committed where the host has cores
    and memory bandwidth to spare; on a small host the two compete and the save blocks longer
    (measured on 2 cores: 5x the blocking time), hence off by default. Host tensors only."""
    slots: int = 2
    """Shared-memory slots per rank, each the size of the rank's state (plus 4%). With 2, a save
    copies into the slot without the newest snapshot, so one complete snapshot survives a crash
    mid-copy and a memory save never waits for a persist. With 1 (hosts that cannot hold two
    copies), the job needs half the memory; a crash mid-copy leaves no snapshot in memory (the
    restart loads from storage), and a save while the slot is persisted waits or is skipped
    (``on_slot_busy``)."""
    on_slot_busy: BusyPolicy = BusyPolicy.WAIT
    """When every slot is still being persisted: wait, or skip the save (reported)."""
    busy_timeout_s: float = 600.0
    commit_timeout_s: float = 600.0
    """How long the committer waits for every rank's files before it marks the step failed."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the storage backend (fsspec options for URLs such as ``s3://``)."""
    storage_factory: str | None = None
    """``"module:attribute"`` of a custom storage factory ``f(url, **storage_options)``."""
    shm_dir: str = "/dev/shm"
    saver_start_timeout_s: float = 60.0
    weights_only: bool = True
    """Load non-tensor values with torch's ``weights_only`` unpickler (no arbitrary code)."""
    pin_memory: bool = True
    """Page-lock slots for device-to-host copies when an accelerator is used."""
    replicas: int = 0
    """Peer nodes that keep a copy of each node's newest memory snapshots (0, 1 or 2), so that a
    replacement node restores from a peer's memory instead of storage. Each replica costs the
    peer two slots of shared memory per rank it holds; copies are made by the savers, in the
    background, over connections authenticated with a per-job secret. ``$FLASHCKPT_REPLICAS``
    overrides it. Default: off."""

    def __post_init__(self) -> None:
        try:
            self.on_slot_busy = BusyPolicy(self.on_slot_busy)
        except ValueError:
            raise ValueError(f"on_slot_busy={self.on_slot_busy!r} must be one of "
                             f"{[p.value for p in BusyPolicy]}") from None
        if not isinstance(self.layout, Layout):
            self.layout = Layout(**self.layout)
        if not isinstance(self.retention, RetentionPolicy):
            self.retention = RetentionPolicy(**self.retention)
        if self.replicas not in (0, 1, 2):
            raise ValueError(f"replicas={self.replicas!r} must be 0 (off), 1 or 2 (peer nodes holding a copy of "
                             "each node's memory snapshots)")
        if self.slots not in (1, 2):
            raise ValueError(f"slots={self.slots!r} must be 1 or 2 (shared-memory copies of the state per rank)")
        for name in ("busy_timeout_s", "commit_timeout_s", "saver_start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive number of seconds")
