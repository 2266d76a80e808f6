#!/usr/bin/env python3
"""Restore from storage into live tensors: ours (engine API and DCP adapter) against the disk's
``O_DIRECT`` read of the same bytes, ``torch.load``, and ``dcp.load`` of ``dcp.async_save`` files.

    python benchmarks/bench_restore.py                      # 1 GiB in 433 float32 tensors, 3 repeats
    python benchmarks/bench_restore.py --gib 4 --repeats 3 --dir /mnt/nvme --json out.json

One process, one torch thread, a gloo group of one rank (DCP needs a group). Setup: the engine
API commits two steps (the restore reads the newer; an older commit is what lets it decode
straight into the live tensors, see ``core/reading.py``), the DCP adapter commits one, and
``dcp.async_save`` (process executor, shared-memory ``DefaultStager``: what a torchtitan user has)
writes one. Every repeat then runs each row once, in an order that is reversed every other repeat,
each after ``fsync`` and ``POSIX_FADV_DONTNEED`` of every file it reads (page cache dropped: a
restart on another node, or after the files were written with ``O_DIRECT``), except the rows
named ``cached``.

| row | what is timed |
|---|---|
| ``odirect_read`` | ``O_DIRECT`` reads (8 MiB) of the engine's file into one buffer: the disk's limit |
| ``buffered_read`` | plain ``read()`` of the same file, uncached |
| ``engine`` | ``Checkpointer.load(prefer_memory=False, target=live)`` |
| ``engine_cached`` | the same with the file in the page cache (read once just before) |
| ``torch_load`` | ``torch.load`` of the same file (uncached) and a copy into the live tensors |
| ``flash_dcp`` | ``flash_dcp.load(ck, state, prefer_memory=False)`` |
| ``dcp_load`` | ``dcp.load`` of the ``async_save`` folder (stock ``FileSystemReader``), uncached |
| ``dcp_load_cached`` | the same as its files sit right after ``async_save`` (in the page cache) |

Target: ``engine`` and ``flash_dcp`` <= 1.3x ``odirect_read``.
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1 << 30


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=433)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write every sample here")
    return parser.parse_args()


def drop(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def odirect_read(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, 8 << 20)
    offset = 0
    try:
        while True:
            n = os.preadv(fd, [buffer], offset)
            offset += n
            if n < len(buffer):
                break
    finally:
        os.close(fd)
        buffer.close()


def buffered_read(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        self.ck = self.dck = None
        self.root = tempfile.mkdtemp(prefix="bench-restore-", dir=args.dir)
        # slots in a private tmpfs folder, removed at the end; one per rank (a restore from storage
        # does not use them, and three copies of the state fit in memory at 4 GiB)
        self.shm_dir = tempfile.mkdtemp(prefix="flashckpt-bench-", dir="/dev/shm")
        dist.init_process_group("gloo", init_method=f"file://{self.root}/store", rank=0, world_size=1)
        try:
            self._setup(args)
        except BaseException:
            self.close()
            raise

    def _setup(self, args: argparse.Namespace) -> None:
        from flashckpt_integrations import Checkpointer
        from flashckpt_integrations.adapters import dcp as flash_dcp

        torch = self.torch
        self.flash_dcp = flash_dcp
        per = int(args.gib * GIB) // 4 // args.tensors
        gen = torch.Generator().manual_seed(0)
        self.state = {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(args.tensors)}
        self.nbytes = per * 4 * args.tensors
        self.dcp_dir = os.path.join(self.root, "dcp")
        self._async_save()  # first: its shared-memory staging is gone before our slots are made
        self.ck = Checkpointer(os.path.join(self.root, "engine"), shm_dir=self.shm_dir, slots=1)
        for step in (1, 2):
            assert self.ck.save(step, self.state).wait(600).committed
        self.engine_file = os.path.join(self.root, "engine", "step-2", "rank-0.pt")
        self.dck = Checkpointer(os.path.join(self.root, "flash-dcp"),
                               flash_dcp.checkpointer_config(shm_dir=self.shm_dir, slots=1))
        flash_dcp.save(self.dck, 1, {"model": self.state})
        assert self.dck.wait(600).committed

    def _async_save(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=False))
        response = dcp.async_save({"model": self.state}, checkpoint_id=self.dcp_dir, async_stager=stager,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        upload = getattr(response, "upload_completion", response)
        upload.result()
        stager.close()

    def files(self, row: str) -> list[str]:
        if row.startswith("dcp_load"):
            return glob.glob(os.path.join(self.dcp_dir, "*"))
        if row == "flash_dcp":
            return glob.glob(os.path.join(self.root, "flash-dcp", "step-1", "*"))
        return [self.engine_file]

    def run_row(self, row: str) -> float:
        import torch.distributed.checkpoint as dcp

        torch = self.torch
        if row.endswith("_cached"):
            for path in self.files(row):
                buffered_read(path)
        else:
            drop(self.files(row))
        with torch.no_grad():
            for tensor in self.state.values():
                tensor.zero_()
        start = time.perf_counter()
        if row == "odirect_read":
            odirect_read(self.engine_file)
        elif row == "buffered_read":
            buffered_read(self.engine_file)
        elif row in ("engine", "engine_cached"):
            result = self.ck.load(prefer_memory=False, target=self.state)
            assert result.step == 2 and result.source == "storage"
        elif row == "torch_load":
            loaded = torch.load(self.engine_file, weights_only=True)
            with torch.no_grad():
                for key, tensor in self.state.items():
                    tensor.copy_(loaded[key])
            del loaded
        elif row == "flash_dcp":
            result = self.flash_dcp.load(self.dck, {"model": self.state}, prefer_memory=False)
            assert result.step == 1 and result.source == "storage"
        else:
            dcp.load({"model": self.state}, checkpoint_id=self.dcp_dir)
        took = time.perf_counter() - start
        if not row.endswith("_read"):
            gen = torch.Generator().manual_seed(0)
            first = next(iter(self.state.values()))
            assert torch.equal(first, torch.randn(first.numel(), generator=gen)), f"{row} restored other values"
        return took

    def close(self) -> None:
        for ck in (self.ck, self.dck):
            if ck is not None:
                ck.close()
        self.dist.destroy_process_group()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


ROWS = ["odirect_read", "buffered_read", "engine", "engine_cached", "torch_load", "flash_dcp", "dcp_load",
        "dcp_load_cached"]


def table(samples: dict[str, list[float]], args: argparse.Namespace, nbytes: int) -> str:
    def paired(key: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[key], samples[base]))

    lines = [f"{nbytes / GIB:.2f} GiB in {args.tensors} float32 tensors, {args.repeats} repeats (order alternated); "
             "x: median over repeats of the ratio within a repeat", "",
             "| row | median s | GB/s | x odirect_read | x dcp_load |", "|---|---|---|---|---|"]
    for row in ROWS:
        med = statistics.median(samples[row])
        lines.append(f"| {row} | {med:.3f} | {nbytes / med / 1e9:.2f} | {paired(row, 'odirect_read'):.2f} | "
                     f"{paired(row, 'dcp_load'):.2f} |")
    for row in ("engine", "flash_dcp"):
        ratio = paired(row, "odirect_read")
        lines.append(f"\ntarget {row} <= 1.3x odirect_read: {ratio:.2f}x {'PASS' if ratio <= 1.3 else 'FAIL'}")
    return "\n".join(lines)


def main() -> int:
    args = parse()
    import logging
    import warnings

    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    bench = Bench(args)
    samples: dict[str, list[float]] = {row: [] for row in ROWS}
    try:
        for repeat in range(args.repeats):
            for row in (ROWS if repeat % 2 == 0 else ROWS[::-1]):
                samples[row].append(bench.run_row(row))
    finally:
        bench.close()
    print(table(samples, args, bench.nbytes), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "tensors": args.tensors, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
