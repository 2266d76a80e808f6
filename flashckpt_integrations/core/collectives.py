"""The few collectives the core needs, working with or without torch.distributed."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(rank: int | None, world_size: int | None, group: Any = None) -> tuple[int, int]:
    """This process's rank and the job's size: given, else torch.distributed, else env."""
    if rank is None:
        rank = dist.get_rank(group) if initialized() else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = dist.get_world_size(group) if initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    return rank, world_size


def all_gather_object(obj: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's JSON-serialisable ``obj``, in rank order; ``[obj]`` in a single-process job.

    Goes through uint8 tensors (not torch's pickle-based object collectives), so it needs
    neither numpy nor unpickling.
    """
    if world_size == 1 or not initialized():
        if world_size != 1:
            raise RuntimeError(
                f"this job has {world_size} ranks but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() before loading, so the ranks can agree"
            )
        return [obj]
    device = collective_device(group)
    payload = json.dumps(obj).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    data = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    data = data.to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, data, group=group)
    return [json.loads(bytes(t[: int(n.item())].cpu().tolist())) for t, n in zip(gathered, sizes)]


def collective_device(group: Any) -> torch.device:
    """CPU for gloo; the current accelerator for backends that need device tensors (nccl)."""
    backend = dist.get_backend(group)
    if backend == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None:  # init_process_group(device_id=...)
        return bound
    # with an index: a bare "cuda" is whatever device this thread has current, GPU 0 if never set
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
