"""Helpers shared by the adapters: which snapshot to resume from, and small files made by stock code."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ..core import collectives
from ..core.engine import Checkpointer
from ..core.state import Codec, FileSpec


def newest_memory_step(ck: Checkpointer, steps: list[int] | None = None) -> int | None:
    """The step ``ck.load()`` would restore from memory (collective), or None.

    Mirrors the rule of ``Checkpointer.load``: a step held complete by every rank and at least as
    new as the newest commit; decided without reading anything from storage. ``steps``: this
    rank's candidates, when an adapter accepts only some of its memory snapshots (default: all).
    """
    committed = ck.committed_steps()
    mine = ck.memory_steps() if steps is None else sorted(steps)
    views = collectives.all_gather_object([mine, committed[-1] if committed else None],
                                          ck.world_size, ck.process_group)
    common = set.intersection(*(set(v[0]) for v in views))
    newest_commit = views[0][1]
    eligible = [s for s in common if newest_commit is None or s >= newest_commit]
    return max(eligible) if eligible else None


def share_from_rank0(files: dict[str, Any], rank: int, is_own: Callable[[str], bool]) -> dict[str, Any]:
    """Give every rank rank 0's files, except the per-rank ones (``is_own(name)``), which each rank keeps.

    Frameworks that write replicated state (weights, optimizer) from rank 0 only do the same in a
    snapshot; on a resume from memory the other ranks get it from rank 0 (collective).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return files
    shared = [{k: v for k, v in files.items() if not is_own(k)} if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return {**shared[0], **{k: v for k, v in files.items() if is_own(k)}}


def files_written_by(write: Callable[[str], Any], skip: Callable[[str], bool] = lambda _: False) -> dict[str, FileSpec]:
    """Let stock code ``write(directory)`` its files into a scratch folder; return them as byte files.

    For the small files (RNG states, configs, sampler states) whose exact content the framework
    defines: they are copied into the snapshot as they are. ``skip(relative_path)`` leaves files out.
    """
    out = {}
    with tempfile.TemporaryDirectory(prefix="flashckpt-files-") as scratch:
        write(scratch)
        for root, _, names in os.walk(scratch):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, scratch).replace(os.sep, "/")
                if not skip(rel):
                    with open(path, "rb") as f:
                        out[rel] = FileSpec(f.read(), Codec.BYTES)
    return out


def write_byte_files(files: Mapping[str, Any], prefix: str) -> str:
    """Write the byte files of a snapshot into a new private folder (for stock loaders); return it."""
    path = tempfile.mkdtemp(prefix=prefix)
    for name, obj in files.items():
        if isinstance(obj, (bytes, bytearray)):
            target = os.path.join(path, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(obj)
    return path
