#!/usr/bin/env python3
"""DeepSpeed ``save_checkpoint``: the flash engine against DeepSpeed's default engine, same model, same run.

    python benchmarks/bench_deepspeed.py                          # ZeRO-2, 128 MiB of fp32 parameters, 2 ranks
    python benchmarks/bench_deepspeed.py --stage 3 --mib 512 --repeats 7 --dir /mnt/nvme

Starts itself under torchrun (``--nproc`` ranks, gloo, ``DS_ACCELERATOR=cpu``). One DeepSpeed engine
(an MLP of ``--mib`` MiB of float32 parameters, torch AdamW, ZeRO ``--stage``) trains one step, then
every repeat runs each metric once, round-robin, with the saver idle and a barrier before each; a
metric's time is the slowest rank's. The first repeat warms up (slots, saver) and is dropped.

| metric | what is timed |
|---|---|
| ``stock`` | ``engine.save_checkpoint`` with DeepSpeed's ``TorchCheckpointEngine`` (torch.save, page cache, no fsync) |
| ``stock+sync`` | the same followed by ``os.sync()`` (the files on disk) |
| ``flash_memory`` | ``engine.save_checkpoint(..., persist=False)`` with the flash engine: snapshot into shared memory |
| ``flash_persist`` | ``engine.save_checkpoint(...)`` persisted: the call (the saver writes in the background) |
| ``flash_committed`` | the same call until every rank's files are fsynced and the step is committed |
| ``stock_load`` / ``flash_load`` | ``engine.load_checkpoint`` from the stock files / from shared memory (ZeRO 0-2) |

The ratio column divides each median by ``stock``'s (``flash_load`` by ``stock_load``'s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=128.0, help="size of the model's float32 parameters")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (plus one warm-up)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default="/tmp", help="where checkpoints are written (a local disk)")
    return parser.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Re-run this script under torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "FLASHCKPT_BENCH_WORKER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def build_engine(args: argparse.Namespace):
    import deepspeed
    import torch

    width = 1024
    layers = max(1, round(args.mib * MIB / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, width)).square().mean()
    engine.backward(loss)
    engine.step()  # the optimizer has its state
    return engine


def slowest(seconds: float) -> float:
    """The slowest rank's time (every rank calls it)."""
    import torch.distributed as dist

    from flashckpt_integrations.core import collectives

    return max(collectives.all_gather_object(seconds, dist.get_world_size()))


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - started)


def measure(args: argparse.Namespace, engine, flash, flash_dir: str, stock_dir: str, repeat: int) -> dict:
    """One round of every metric."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, float] = {}
    base = 10 * (repeat + 1)
    tag = f"global_step{base}"

    def fresh_stock() -> None:
        if rank == 0:
            shutil.rmtree(stock_dir, ignore_errors=True)
        os.sync()

    fresh_stock()
    out["stock"] = timed(lambda: engine.save_checkpoint(stock_dir, tag=tag))
    fresh_stock()
    out["stock+sync"] = timed(lambda: (engine.save_checkpoint(stock_dir, tag=tag), os.sync()))
    flash.wait()
    out["flash_memory"] = timed(lambda: engine.save_checkpoint(flash_dir, tag=f"global_step{base + 1}",
                                                               persist=False))
    flash.wait()
    os.sync()
    out["flash_persist"] = timed(lambda: engine.save_checkpoint(flash_dir, tag=f"global_step{base + 2}"))
    flash.wait()
    os.sync()
    out["flash_committed"] = timed(lambda: (engine.save_checkpoint(flash_dir, tag=f"global_step{base + 3}"),
                                            flash.wait()))
    if args.stage < 3:  # ZeRO-3 cannot load into an engine that has saved (DeepSpeed's rule)
        out["stock_load"] = timed(lambda: engine.load_checkpoint(stock_dir, tag=tag))
        out["flash_load"] = timed(lambda: engine.load_checkpoint(flash_dir))
        assert flash.last_load[1] == "memory", flash.last_load
    return out


def report(args: argparse.Namespace, samples: list[dict], state_mib: float) -> None:
    print(f"\nDeepSpeed ZeRO-{args.stage}, {args.nproc} ranks, "
          f"{state_mib:.0f} MiB checkpoint per save (all ranks), {len(samples)} repeats; seconds, slowest rank")
    rows = list(samples[0])
    medians = {m: statistics.median(s[m] for s in samples) for m in rows}
    print(f"| {'metric':<16} | {'median s':>9} | {'min s':>8} | {'ratio':>12} |")
    print(f"|{'-' * 18}|{'-' * 11}|{'-' * 10}|{'-' * 14}|")
    for metric in rows:
        base = "stock_load" if metric.endswith("_load") else "stock"
        ratio = medians[metric] / medians[base] if medians[base] else float("nan")
        print(f"| {metric:<16} | {medians[metric]:>9.4f} | {min(s[metric] for s in samples):>8.4f} | "
              f"{ratio:>6.3f}x {base.replace('stock_load', 'load'):<5} |")


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import torch.distributed as dist

    from flashckpt_integrations.adapters import deepspeed as flash_ds

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    work = tempfile.mkdtemp(prefix="bench-ds-", dir=args.dir) if rank == 0 else None
    box = [work]
    dist.broadcast_object_list(box, src=0)
    work = box[0]
    flash_dir, stock_dir = os.path.join(work, "flash"), os.path.join(work, "stock")
    engine = build_engine(args)
    flash = flash_ds.enable(engine, flash_dir, config={"retention": {"keep_last": 2}})
    samples = []
    try:
        for repeat in range(args.repeats + 1):
            sample = measure(args, engine, flash, flash_dir, stock_dir, repeat)
            if repeat:
                samples.append(sample)
        flash.wait()
        sizes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(stock_dir) for f in fs
                    if f.endswith(".pt"))
        if rank == 0:
            report(args, samples, sizes / MIB)
    finally:
        flash.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    args = parse()
    if os.environ.get("FLASHCKPT_BENCH_WORKER") != "1":
        return launch(args)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
