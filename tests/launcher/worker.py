"""A training loop for the launcher tests: each step's state is a function of (step, rank).

Run under torchrun or flashckpt-run::

    worker.py --ckpt DIR --out DIR --steps N [--raise-at RANK:STEP] [--step-sleep S]

Resumes with ``Checkpointer.load()``, then at every step takes a memory-only snapshot of
``state(step, rank)`` and meets the other ranks in a barrier (as DDP's all-reduce would).
``--raise-at`` makes that rank raise a ValueError at that step, before its snapshot. Each rank
keeps ``<out>/rank-<rank>.json`` up to date: pid, what it loaded, the last step it saved.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from flashckpt_integrations import Checkpointer


def state(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(64, 256, generator=g), "step": step, "rank": rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--raise-at", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = Checkpointer(args.ckpt)
    loaded = ck.load()
    record = {"rank": rank, "pid": os.getpid(), "loaded": loaded and loaded.step,
              "source": loaded and loaded.source, "last_saved": None}
    path = os.path.join(args.out, f"rank-{rank}.json")

    def flush() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    flush()
    fail_rank, fail_step = map(int, args.raise_at.split(":")) if args.raise_at else (None, None)
    for step in range((loaded.step + 1) if loaded else 1, args.steps + 1):
        if (rank, step) == (fail_rank, fail_step):
            raise ValueError(f"injected failure at step {step} on rank {rank}")
        result = ck.save(step, state(step, rank), persist=False)
        assert result.ok, result
        record["last_saved"] = step
        flush()
        dist.barrier()
        time.sleep(args.step_sleep)
    ck.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit


if __name__ == "__main__":
    main()
