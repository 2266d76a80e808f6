"""The few collectives the core needs, working with or without torch.distributed."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(rank: int | None, world_size: int | None, group: Any = None) -> tuple[int, int]:
    """This process's rank and the job's size: given, else torch.distributed, else env."""
    if rank is None:
        rank = dist.get_rank(group) if _initialized() else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = dist.get_world_size(group) if _initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    return rank, world_size


def all_gather_object(obj: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order; just ``[obj]`` in a single-process job."""
    if world_size == 1 or not _initialized():
        if world_size != 1:
            raise RuntimeError(
                f"this job has {world_size} ranks but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() before loading, so the ranks can agree"
            )
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out
