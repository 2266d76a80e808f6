"""An FSDP2 training run for the DCP tests (run under torchrun, 2 ranks, gloo).

``--steps N``: train up to step N. ``--persist-at``/``--memory-at``: steps to save through the
flash DCP layer (persisted / memory only); ``--persist-every``/``--snapshot-every``: the same by
period. ``--kill-at S``: SIGKILL every rank right after step S; ``--pause-at S``: after step S's save,
touch ``<out>/paused-<rank>`` and wait to be killed; ``--hold-at S``: after step S's save, touch
``<out>/held-<rank>`` and wait for ``<out>/go``, then train on. ``--resume``: load the newest checkpoint first
(``--prefer-storage``: from storage). ``--dump-at``: steps whose full model and optimizer state rank 0
writes to ``<out>/full-<step>.pt``. ``--checks``: after training, try a load into a mismatched
model and non-collective save/load calls (rank 0 alone), recording the errors.
Each rank writes ``<out>/rank-<rank>.json`` (with ``--storage-factory tests.helpers:CountingStorage``,
the data bytes its load read from storage).
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from flashckpt_integrations import Checkpointer
from flashckpt_integrations.adapters import dcp as flash_dcp
from tests.helpers import CountingStorage, exit_without_teardown


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


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def dump(model: nn.Module, optimizer: torch.optim.Optimizer, out: str, step: int, steps: list[int], rank: int) -> None:
    if step in steps:
        full = full_state(model, optimizer)
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
    parser.add_argument("--persist-every", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--prefer-storage", action="store_true")
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--storage-factory", default=None)
    parser.add_argument("--checks", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer}
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config(commit_timeout_s=120), replicas=args.replicas,
                      storage_factory=args.storage_factory)
    record: dict = {"rank": rank, "world": dist.get_world_size(), "pid": os.getpid(), "run_dir": ck.run_dir,
                    "events": []}
    path = os.path.join(args.out, f"rank-{rank}.json")

    def flush() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    start = 0
    if args.resume:
        loaded = flash_dcp.load(ck, state, prefer_memory=not args.prefer_storage)
        record["events"].append({"load": loaded and loaded.step, "source": loaded and loaded.source})
        record["lineage_commits"] = ck.committed_steps()  # what a restart of this attempt could still load
        if args.storage_factory == "tests.helpers:CountingStorage":
            record["events"][-1]["storage_bytes"] = sum(CountingStorage.data_bytes.values())
        start = loaded.step if loaded is not None else 0
        dump(model, optimizer, args.out, start, args.dump_at, rank)
    for step in range(start + 1, args.steps + 1):
        train_step(model, optimizer, step, rank)
        dump(model, optimizer, args.out, step, args.dump_at, rank)
        persist = step in args.persist_at or bool(args.persist_every and step % args.persist_every == 0)
        if persist or step in args.memory_at or bool(args.snapshot_every and step % args.snapshot_every == 0):
            result = flash_dcp.save(ck, step, state, persist=persist)
            record["events"].append({"save": step, "status": result.status.value})
            if persist:
                record["events"][-1]["committed"] = result.wait().committed
        if step == args.kill_at:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hold_at:
            flush()
            open(os.path.join(args.out, f"held-{rank}"), "w").close()
            while not os.path.exists(os.path.join(args.out, "go")):
                time.sleep(0.1)
        if step == args.pause_at:
            flush()
            open(os.path.join(args.out, f"paused-{rank}"), "w").close()
            while True:
                time.sleep(1)
    if args.checks:
        record["events"].append(checks(ck, rank))
    ck.wait()
    ck.close()
    flush()
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
