"""An FSDP2 training run for the DCP tests (run under torchrun, 2 ranks, gloo).

``--steps N``: train up to step N. ``--persist-at``/``--memory-at``: steps to save through the
flash DCP layer (persisted / memory only). ``--kill-at S``: SIGKILL every rank right after step S.
``--resume``: load the newest checkpoint first. ``--dump-at``: steps whose full model state rank 0
writes to ``<out>/full-<step>.pt``. ``--checks``: after training, try a load into a mismatched
model and non-collective save/load calls (rank 0 alone), recording the errors.
Each rank writes ``<out>/rank-<rank>.json``.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from flashckpt_integrations import Checkpointer
from flashckpt_integrations.adapters import dcp as flash_dcp
from tests.helpers import exit_without_teardown


def build_model(width: int = 32, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers += [nn.Linear(16 if i == 0 else width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def shard(model: nn.Module) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(-1, keepdim=True).sin()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def dump(model: nn.Module, out: str, step: int, steps: list[int], rank: int) -> None:
    if step in steps:
        full = full_state(model)
        if rank == 0:
            torch.save(full, os.path.join(out, f"full-{step}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--persist-at", type=int, nargs="*", default=[])
    parser.add_argument("--memory-at", type=int, nargs="*", default=[])
    parser.add_argument("--dump-at", type=int, nargs="*", default=[])
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checks", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict = {"rank": rank, "events": []}
    model = shard(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer}
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config(commit_timeout_s=120))
    start = 0
    if args.resume:
        loaded = flash_dcp.load(ck, state)
        record["events"].append({"load": loaded.step, "source": loaded.source})
        start = loaded.step
        dump(model, args.out, start, args.dump_at, rank)
    for step in range(start + 1, args.steps + 1):
        train_step(model, optimizer, step, rank)
        dump(model, args.out, step, args.dump_at, rank)
        if step in args.persist_at or step in args.memory_at:
            result = flash_dcp.save(ck, step, state, persist=step in args.persist_at)
            record["events"].append({"save": step, "status": result.status.value})
            if step in args.persist_at:
                record["events"][-1]["committed"] = result.wait().committed
        if step == args.kill_at:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    if args.checks:
        record["events"].append(checks(ck, rank))
    ck.wait()
    ck.close()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def checks(ck: Checkpointer, rank: int) -> dict:
    """Errors seen on bad input: a mismatched model, and calls made by rank 0 alone."""
    seen = {}
    other = shard(build_model(width=24, depth=4))
    try:
        flash_dcp.load(ck, {"model": other}, prefer_memory=False)
    except Exception as exc:
        seen["mismatch"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        for op in ("save", "load"):
            try:
                if op == "save":
                    flash_dcp.save(ck, 99, {"x": {"w": torch.zeros(2)}}, timeout_s=3)
                else:
                    flash_dcp.load(ck, {"x": {"w": torch.zeros(2)}}, timeout_s=3)
            except Exception as exc:
                seen[op] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return seen


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
