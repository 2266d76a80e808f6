"""Where a checkpoint's files, markers and tracker live on storage, and what counts as committed.

For step ``N`` with ``step_dir="step-{step}"``::

    <root>/step-N/...                          the ranks' files (the framework's native layout)
    <root>/.flashckpt/steps/N/rank-<r>.done    rank r's files are durable (JSON: paths, sizes, crc32)
    <root>/.flashckpt/steps/N/rank-<r>.failed  rank r could not persist (JSON: the error)
    <root>/.flashckpt/steps/N/COMMITTED        written once, by the committer, after every marker
    <root>/.flashckpt/steps/N/FAILED           the commit gave up (JSON: why)
    <root>/<tracker>                           e.g. "latest", written just before COMMITTED

With ``staging`` the ranks write under ``.flashckpt/staging/step-N/`` and the committer renames
that directory to ``step-N`` before it writes COMMITTED, so a reader that finds checkpoints by
directory name (as HF's ``get_last_checkpoint`` does) never sees a partial one.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from .storage import Storage, write_bytes

META_DIR = ".flashckpt"
COMMITTED = "COMMITTED"
FAILED = "FAILED"


@dataclass(frozen=True)
class Layout:
    """Names of a checkpoint's directories and tracker; adapters set their framework's own."""

    step_dir: str = "step-{step}"
    """Template of a step's directory, relative to the root; ``{step}`` is the step number."""
    tracker: str | None = "latest"
    """Path of the tracker file relative to the root, rewritten at every commit; None for none."""
    tracker_content: str = "{step}\n"
    """Template of the tracker's content; ``{step}`` and ``{step_dir}`` are filled in."""
    staging: bool = False
    """Write into a staging directory and rename it into place at commit."""

    def __post_init__(self) -> None:
        if "{step" not in self.step_dir:
            raise ValueError(f"step_dir template {self.step_dir!r} must contain '{{step}}'")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def step_path(self, step: int) -> str:
        return self.step_dir.format(step=step)

    def write_path(self, step: int) -> str:
        """Directory the ranks write into before the commit."""
        if self.staging:
            return f"{META_DIR}/staging/{self.step_path(step)}"
        return self.step_path(step)

    @staticmethod
    def marker_dir(step: int) -> str:
        return f"{META_DIR}/steps/{step}"

    def rank_marker(self, step: int, rank: int, ok: bool = True) -> str:
        return f"{self.marker_dir(step)}/rank-{rank}.{'done' if ok else 'failed'}"

    def tracker_bytes(self, step: int) -> bytes:
        return self.tracker_content.format(step=step, step_dir=self.step_path(step)).encode()


def write_json(storage: Storage, path: str, obj: Any) -> None:
    write_bytes(storage, path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(storage: Storage, path: str) -> Any:
    return json.loads(storage.read(path))


def marked_steps(storage: Storage) -> list[int]:
    """Every step that has a marker directory, ascending."""
    steps = []
    for name in storage.list(f"{META_DIR}/steps"):
        if name.lstrip("-").isdigit():
            steps.append(int(name))
    return sorted(steps)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose commit record exists, ascending: the only steps a loader may read."""
    return [s for s in marked_steps(storage) if storage.exists(f"{Layout.marker_dir(s)}/{COMMITTED}")]


def commit_record(storage: Storage, step: int) -> dict[str, Any] | None:
    path = f"{Layout.marker_dir(step)}/{COMMITTED}"
    return read_json(storage, path) if storage.exists(path) else None


def failure_record(storage: Storage, step: int) -> dict[str, Any] | None:
    path = f"{Layout.marker_dir(step)}/{FAILED}"
    return read_json(storage, path) if storage.exists(path) else None


def now() -> float:
    return time.time()


def write_rank_done(storage: Storage, layout: Layout, request: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """Publish a rank's done marker for ``request``'s step: its files are durable (the seq names the snapshot)."""
    rank, step = int(request["rank"]), int(request["step"])
    write_json(storage, layout.rank_marker(step, rank), {
        "rank": rank, "step": step, "seq": int(request["seq"]), "world_size": request["world_size"],
        "files": entries, "time": now(),
    })


def write_rank_failed(storage: Storage, layout: Layout, step: int, rank: int, exc: BaseException) -> None:
    """Publish a rank's failed marker (best effort: the storage may be what failed)."""
    with contextlib.suppress(Exception):
        write_json(storage, layout.rank_marker(step, rank, ok=False),
                   {"rank": rank, "step": step, "error": f"{type(exc).__name__}: {exc}"})
