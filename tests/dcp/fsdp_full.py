"""Full state dicts of FSDP1 / FSDP2 models through the flash layer (torchrun, 2 ranks, gloo).

Trains 2 steps, dumps the full state as torch gathers it (``<out>/expected.pt``), saves it with
``save_full``, loads it into fresh sharded models from memory and from storage, and checks that
the loaded models hold the same state and train on identically. Rank 0 writes ``<out>/result.json``.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_train import build_model, train_step  # noqa: E402

from flashckpt_integrations import Checkpointer  # noqa: E402
from flashckpt_integrations.adapters import fsdp as flash_fsdp  # noqa: E402
from tests.helpers import exit_without_teardown  # noqa: E402


def make(version: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_model()
    if seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            nn.init.normal_(p)
    if version == 1:
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True)  # every rank gets everything
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fsdp", type=int, choices=(1, 2), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = make(args.fsdp, 0)
    for step in (1, 2):
        train_step(model, optimizer, step, rank)
    expected = full(model, optimizer)
    if rank == 0:
        torch.save(expected, os.path.join(args.out, "expected.pt"))
    ck = Checkpointer(args.ckpt)
    result = {"committed": flash_fsdp.save_full(ck, 2, model, optimizer).wait().committed}
    for name, prefer_memory in (("memory", True), ("storage", False)):
        other, other_optimizer = make(args.fsdp, 7)
        loaded = flash_fsdp.load_full(ck, other, other_optimizer, prefer_memory=prefer_memory)
        result[name] = {"step": loaded.step, "source": loaded.source, "equal": same(full(other, other_optimizer),
                                                                                     expected)}
        train_step(other, other_optimizer, 3, rank)
        result[name]["trains_on"] = (other, other_optimizer)
    train_step(model, optimizer, 3, rank)
    after = full(model, optimizer)
    for name in ("memory", "storage"):
        result[name]["trains_on"] = same(full(*result[name]["trains_on"]), after)
    result["files"] = sorted(os.listdir(os.path.join(args.ckpt, "step-2"))) if rank == 0 else None
    ck.close()
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
