"""DDP training with flash checkpoints, on CPU (gloo) and synthetic MNIST-like data.

Run it under torchrun::

    torchrun --nproc-per-node 2 examples/ddp/train.py --ckpt-dir /tmp/ckpt --steps 40 \
        --save-every 5 --persist-every 20 [--crash-at-step 30] [--out final.pt] [--compare-torch-save]

Every ``--save-every`` steps each rank snapshots model, optimizer, RNG state and step into shared
memory (``persist=False``); every ``--persist-every`` steps the snapshot is also written to
``--ckpt-dir`` in the background. On start the script calls ``Checkpointer.load()``: after a crash
(even a ``kill -9``) the relaunch finds the newest snapshot in shared memory and continues from
the step after it. Each step's batch is a pure function of (seed, step, rank), so a resumed run
ends with exactly the same parameters as an uninterrupted one.

``--crash-at-step S`` kills rank 0 with SIGKILL right after the save at step S (once every rank
has finished that save), to simulate a node failure after a memory-only snapshot.

Rank 0 prints one JSON line at the end: where it resumed from, the final step, and the mean
time ``save`` held training, next to the time a plain ``torch.save`` of the same state takes
(with ``--compare-torch-save``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashckpt_integrations import Checkpointer, RetentionPolicy

IMAGE_PIXELS = 28 * 28
CLASSES = 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="where persisted checkpoints go (also names the job)")
    parser.add_argument("--steps", type=int, default=40, help="train until this step (inclusive)")
    parser.add_argument("--save-every", type=int, default=5, help="memory snapshot every K steps")
    parser.add_argument("--persist-every", type=int, default=20, help="also persist to --ckpt-dir every P steps")
    parser.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL rank 0 after the save at step S")
    parser.add_argument("--out", default=None, help="rank 0 writes the final model.state_dict() here")
    parser.add_argument("--compare-torch-save", action="store_true",
                        help="rank 0 also times a plain torch.save of the state at each persisted save")
    parser.add_argument("--hidden", type=int, default=2560, help="MLP width (2560: ~8.6M parameters)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.save_every < 1 or args.persist_every < 1:
        parser.error("--save-every and --persist-every must be >= 1")
    crash = args.crash_at_step
    if crash is not None and crash % args.save_every and crash % args.persist_every:
        parser.error("--crash-at-step must be a step that saves (a multiple of --save-every or --persist-every)")
    return args


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(IMAGE_PIXELS, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),  # uses the RNG: shows that its state is checkpointed too
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def make_prototypes(seed: int) -> torch.Tensor:
    """One fixed random 28x28 'digit' per class: the hidden structure the model has to learn."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(CLASSES, 1, 28, 28, generator=generator)


def make_batch(seed: int, step: int, rank: int, batch_size: int, prototypes: torch.Tensor):
    """The batch of ``step`` on ``rank``: a function of (seed, step, rank) only, never of history.

    Labels are uniform; an image is its class prototype blurred by noise, squashed to [0, 1].
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    noise = torch.randn(batch_size, 1, 28, 28, generator=generator)
    images = torch.sigmoid(0.5 * prototypes[labels] + noise)
    return images, labels


def training_state(model: DDP, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = DDP(build_model(args.hidden))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed + 1 + rank)  # per-rank dropout stream
    prototypes = make_prototypes(args.seed)

    ck = Checkpointer(args.ckpt_dir, optimizers=[optimizer], retention=RetentionPolicy(keep_last=2))

    # --- resume ------------------------------------------------------------------------------
    started = time.perf_counter()
    res = ck.load()  # collective: every rank calls it
    load_ms = (time.perf_counter() - started) * 1e3
    start_step = 1
    if res is not None:
        state = res.state
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start_step = int(state["step"]) + 1
        if rank == 0:
            print(f"[rank 0] resumed from step {res.step} ({res.source}) in {load_ms:.0f} ms", flush=True)
    elif rank == 0:
        print("[rank 0] no checkpoint found: starting from scratch", flush=True)

    # --- train -------------------------------------------------------------------------------
    save_ms: list[float] = []
    torch_save_ms: list[float] = []
    probe = None  # a plain torch.save target on the same file system as the checkpoints
    if args.compare_torch_save and rank == 0:
        ckpt_dir = os.path.abspath(args.ckpt_dir)
        probe = os.path.join(os.path.dirname(ckpt_dir), f".{os.path.basename(ckpt_dir)}.torch-save-probe.pt")
    train_started = time.perf_counter()
    step = start_step - 1
    for step in range(start_step, args.steps + 1):
        images, labels = make_batch(args.seed, step, rank, args.batch_size, prototypes)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == start_step:
            # Size and pre-fault both shared-memory slots once the optimizer has created its state
            # (torch optimizers do that lazily, at their first step), so no save pays for it.
            ck.prepare(training_state(model, optimizer, step))

        if step % args.save_every and step % args.persist_every:
            continue
        persist = step % args.persist_every == 0
        state = training_state(model, optimizer, step)
        result = ck.save(step, state, persist=persist)
        if not result.ok:
            raise RuntimeError(f"rank {rank}: save of step {step} {result.status.value}: {result.reason}")
        save_ms.append(result.blocking_s * 1e3)
        if probe is not None and persist:
            t0 = time.perf_counter()
            torch.save(state, probe)
            torch_save_ms.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            kind = "memory + persist" if persist else "memory"
            print(f"[rank 0] step {step:4d} loss {loss.item():.4f} saved ({kind}) "
                  f"blocking {result.blocking_s * 1e3:.1f} ms", flush=True)
        if step == args.crash_at_step:
            dist.barrier()  # every rank's snapshot of this step is complete before the "crash"
            if rank == 0:
                print(f"[rank 0] simulating a crash: SIGKILL after the save at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    train_s = time.perf_counter() - train_started

    # --- finish ------------------------------------------------------------------------------
    final = ck.wait()
    if final is not None and not final.committed:
        raise RuntimeError(f"rank {rank}: last persisted step {final.step} was not committed: {final.error}")
    if probe is not None and os.path.exists(probe):
        os.unlink(probe)
    if rank == 0:
        if args.out:
            torch.save(model.module.state_dict(), args.out)
        summary = {
            "resumed_from_step": res.step if res is not None else None,
            "source": res.source if res is not None else None,
            "load_ms": round(load_ms, 1),
            "final_step": step,
            "world_size": world_size,
            "params": sum(p.numel() for p in model.parameters()),
            "state_mb": round(_state_bytes(training_state(model, optimizer, step)) / 2**20, 1),
            "saves": len(save_ms),
            "save_ms_mean": round(statistics.fmean(save_ms), 2) if save_ms else None,
            "save_ms_median": round(statistics.median(save_ms), 2) if save_ms else None,
            "save_ms_max": round(max(save_ms), 2) if save_ms else None,
            "torch_save_ms_mean": round(statistics.fmean(torch_save_ms), 2) if torch_save_ms else None,
            "torch_save_ms_median": round(statistics.median(torch_save_ms), 2) if torch_save_ms else None,
            "torch_saves": len(torch_save_ms),
            "committed_steps": ck.committed_steps(),
            "train_s": round(train_s, 2),
        }
        print(json.dumps(summary), flush=True)
    ck.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can abort at interpreter exit; everything is closed and flushed by now


def _state_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


if __name__ == "__main__":
    main()
