"""Where a checkpoint's files, markers and tracker live on storage, and what counts as committed.

For step ``N`` with ``step_dir="step-{step}"``::

    <root>/step-N/...                          the ranks' files (the framework's native layout)
    <root>/.flashckpt/steps/N/rank-<r>.<sid>.done    rank r's files of save <sid> are durable
                                                     (JSON: paths, sizes, crc32, where they are)
    <root>/.flashckpt/steps/N/rank-<r>.<sid>.failed  rank r could not persist (JSON: the error)
    <root>/.flashckpt/steps/N/COMMITTED        the commit record: which save of step N counts
    <root>/.flashckpt/steps/N/FAILED           the newest save of step N gave up (JSON: why)
    <root>/.flashckpt/steps/N/DELETING         retention is deleting step N (written before COMMITTED goes)
    <root>/<tracker>                           e.g. "latest", written just before COMMITTED

A save id (``sid``) names one save of a step by one attempt (its lineage, see :mod:`.lineage`),
so two attempts that save the same step never share a marker or a file. With ``staging`` the
ranks write under ``.flashckpt/staging/N.<sid>/step-N/`` and the committer renames that directory
to ``step-N`` when it commits, so a reader that finds checkpoints by directory name (as HF's
``get_last_checkpoint`` does) never sees a partial one. A save of a step that is committed
already is always staged: the old files stay the ones that load until the new commit record
names the new ones (:func:`files_dir`).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from .._utils.crc32 import crc32
from ..errors import StorageError
from .storage import Storage, write_bytes

META_DIR = ".flashckpt"
COMMITTED = "COMMITTED"
FAILED = "FAILED"
DELETING = "DELETING"
"""Retention's tombstone: a step that has it and no COMMITTED is a half-deleted leftover, never a save in flight."""


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
    folder: str | None = None
    """One save's own directory, relative to the root, in place of ``step_dir`` (a per-save
    destination: ``Checkpointer.save(step, ..., folder=...)`` sets it on the save's layout)."""

    def __post_init__(self) -> None:
        if "{step" not in self.step_dir:
            raise ValueError(f"step_dir template {self.step_dir!r} must contain '{{step}}'")
        if self.folder is not None:
            parts = self.folder.replace("\\", "/").split("/")
            if (not self.folder or self.folder.startswith("/") or ".." in parts or "" in parts
                    or parts[0] == META_DIR):
                raise ValueError(f"folder {self.folder!r} must be a path relative to the checkpoint directory, "
                                 f"without '..' or empty parts, outside {META_DIR}/")

    def for_folder(self, folder: str | None) -> Layout:
        """This layout with one save's own directory (``folder``), or as it is for None."""
        return self if folder is None else replace(self, folder=folder)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def step_path(self, step: int) -> str:
        return self.folder if self.folder is not None else self.step_dir.format(step=step)

    def write_path(self, step: int, sid: str = "", *, supersede: bool = False) -> str:
        """Directory the ranks of save ``sid`` write into before the commit.

        Staged (``staging``, or ``supersede``: the step is committed already and its files must
        stay intact until the new commit) or the step's own directory.
        """
        if self.staging or supersede:
            root = self.staging_root(step, sid)
            return f"{root}/{self.step_path(step)}" if sid else f"{META_DIR}/staging/{self.step_path(step)}"
        return self.step_path(step)

    @staticmethod
    def is_data_file(path: str) -> bool:
        """Whether ``path`` (relative to the checkpoint directory) is a checkpoint's file, staged or
        in place, rather than a marker or record of the commit protocol."""
        return not path.startswith(META_DIR) or path.startswith(f"{META_DIR}/staging/")

    @staticmethod
    def staging_root(step: int, sid: str) -> str:
        """The folder that holds save ``sid`` of ``step`` while it is staged (its alone: removed at commit)."""
        return f"{META_DIR}/staging/{step}.{sid}"

    @staticmethod
    def marker_dir(step: int) -> str:
        return f"{META_DIR}/steps/{step}"

    def rank_marker(self, step: int, rank: int, ok: bool = True, sid: str = "") -> str:
        return f"{self.marker_dir(step)}/{marker_name(rank, sid, ok)}"

    def tracker_bytes(self, step: int) -> bytes:
        return self.tracker_content.format(step=step, step_dir=self.step_path(step)).encode()


def marker_name(rank: int, sid: str = "", ok: bool = True) -> str:
    """File name of rank ``rank``'s marker for save ``sid`` ("" for saves made before save ids)."""
    return f"rank-{rank}{'.' + sid if sid else ''}.{'done' if ok else 'failed'}"


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
    try:
        return read_json(storage, path) if storage.exists(path) else None
    except StorageError:
        if storage.exists(path):
            raise
        return None  # retention deleted it between the check and the read


def commit_records(storage: Storage) -> dict[int, dict[str, Any]]:
    """The commit record of every committed step, by step."""
    records = {}
    for step in marked_steps(storage):
        record = commit_record(storage, step)
        if record is not None:
            records[step] = record
    return records


def files_dir(storage: Storage, layout: Layout, step: int, record: dict[str, Any] | None) -> str:
    """Where the files of committed ``step`` are: the record's directory, or the step's own
    once the committer has moved a superseding save into place."""
    record = record or {}
    path = record.get("files_dir") or layout.step_path(step)
    final = record.get("final_dir")
    if final and path != final and not storage.exists(path):
        return final  # moved (a rename: all of it or none of it)
    return path


def file_mismatch(path: str, data: bytes, entry: dict[str, Any]) -> str | None:
    """Why the bytes read from committed file ``path`` are not the ones its rank marker ``entry``
    recorded (size and crc32), or None when they are."""
    return checksum_mismatch(path, len(data), crc32(data), entry)


def checksum_mismatch(path: str, size: int, crc: int, entry: dict[str, Any]) -> str | None:
    """Why a committed file of ``size`` bytes and ``crc`` is not the one its rank marker
    ``entry`` recorded, or None when it is."""
    if size == entry["size"] and crc == entry["crc32"]:
        return None
    return (f"{path}: size/checksum {size}/{crc} differ from the {entry['size']}/{entry['crc32']} recorded "
            "when it was written; the file was changed or truncated after the commit")


def failure_record(storage: Storage, step: int) -> dict[str, Any] | None:
    path = f"{Layout.marker_dir(step)}/{FAILED}"
    return read_json(storage, path) if storage.exists(path) else None


def now() -> float:
    return time.time()


def write_rank_done(
    storage: Storage, layout: Layout, request: dict[str, Any], entries: list[dict[str, Any]], base: str,
) -> None:
    """Publish a rank's done marker for ``request``'s save: its files are durable under ``base``
    (the seq names the snapshot)."""
    rank, step, sid = int(request["rank"]), int(request["step"]), request.get("sid", "")
    write_json(storage, layout.rank_marker(step, rank, sid=sid), {
        "rank": rank, "step": step, "seq": int(request["seq"]), "world_size": request["world_size"],
        "files": entries, "time": now(), "sid": sid, "base": base,
    })


def write_rank_failed(storage: Storage, layout: Layout, request: dict[str, Any], exc: BaseException) -> None:
    """Publish a rank's failed marker (best effort: the storage may be what failed)."""
    rank, step, sid = int(request["rank"]), int(request["step"]), request.get("sid", "")
    with contextlib.suppress(Exception):
        write_json(storage, layout.rank_marker(step, rank, ok=False, sid=sid),
                   {"rank": rank, "step": step, "sid": sid, "error": f"{type(exc).__name__}: {exc}"})
