#!/usr/bin/env python3
"""Sharded DCP checkpoints: the flash DCP layer against ``dcp.save`` and ``dcp.async_save``.

    python benchmarks/bench_dcp.py                       # 2 GiB of DTensors over 2 ranks, 7 repeats
    python benchmarks/bench_dcp.py --gib 2 --repeats 7 --dir /mnt/nvme --json out.json

Starts itself under torchrun (``--nproc`` ranks, gloo, CPU). The state is ``--tensors`` float32
DTensors sharded on a 1-D mesh (``Shard(0)``), ``--gib`` in total, plus a small replicated part.
Every repeat runs each metric once, round-robin (``raw_copy`` and the flash save swap places each
repeat), each after ``os.sync()``, a ``--settle`` pause and a barrier; a metric's time is the
slowest rank's. The first repeat warms up (slots, saver, process executor) and is dropped.

| metric | what is timed |
|---|---|
| ``raw_copy`` | ``.copy_`` of the rank's shards into a warm, pre-touched ``/dev/shm`` mapping (the limit) |
| ``flash_blocking`` | ``flash_dcp.save(ck, step, state)`` until it returns (planning + copy into the slot) |
| ``flash_committed`` | the same call until ``result.wait()`` reports the step committed (files fsynced) |
| ``dcp.save`` | ``dcp.save`` to a fresh folder (blocking = committed) |
| ``async_thread`` / ``_done`` | ``dcp.async_save`` (thread executor): the call, and until its future completes |
| ``async_process`` / ``_done`` | the same with ``AsyncCheckpointerType.PROCESS`` |

Targets: ``flash_blocking`` <= 1.2x ``raw_copy``; ``flash_committed`` <= ``dcp.save``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

GIB = 1 << 30


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="total size of the sharded state")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="measured repeats (plus one warm-up)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default="/tmp", help="where checkpoints are written (a local disk)")
    parser.add_argument("--json", default=None, help="also write every sample here")
    parser.add_argument("--skip-async", action="store_true", help="leave out dcp.async_save (thread and process)")
    parser.add_argument("--settle", type=float, default=1.0, help="pause (s) after os.sync() before each metric")
    return parser.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Re-run this script under torchrun."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHCKPT_BENCH_WORKER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def make_state(gib: float, count: int, mesh) -> dict:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = 1024
    cols = max(1, int(gib * GIB) // 4 // count // rows)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": distribute_tensor(torch.randn(rows, cols, generator=gen), mesh, [Shard(0)])
             for i in range(count)}
    return {"model": model, "extra": {"step": torch.tensor(3), "lr": 0.1}}


def local_shards(state: dict) -> list:
    return [t.to_local() for t in state["model"].values()]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from flashckpt_integrations import Checkpointer
        from flashckpt_integrations.adapters import dcp as flash_dcp

        dist.init_process_group("gloo")
        self.torch, self.dist, self.flash_dcp = torch, dist, flash_dcp
        self.rank = dist.get_rank()
        self.args = args
        self.state = make_state(args.gib, args.tensors, init_device_mesh("cpu", (dist.get_world_size(),)))
        self.shards = local_shards(self.state)
        nbytes = sum(t.numel() * t.element_size() for t in self.shards)
        self.root = self.broadcast(tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir) if self.rank == 0 else None)
        self.shm_path = f"/dev/shm/bench-dcp-raw-{uuid.uuid4().hex}"
        self.raw = torch.from_file(self.shm_path, shared=True, size=nbytes, dtype=torch.uint8)
        self.raw.fill_(1)  # pre-touch: a warm mapping
        self.ck = Checkpointer(os.path.join(self.root, "flash"), flash_dcp.checkpointer_config())
        self.step = 0
        self.nbytes = nbytes

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def timed(self, fn) -> dict[str, float]:
        """Run ``fn`` (returns {metric: seconds}) after a settle and a barrier; the slowest rank's times.

        Every metric starts on a quiet disk: ``os.sync()`` and a short pause first, so no metric pays
        for the writeback of the one before it (1 GiB saves follow each other here).
        """
        if self.rank == 0:
            os.sync()
        self.dist.barrier()
        time.sleep(self.args.settle)
        self.dist.barrier()
        local = fn()
        gathered = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(gathered, local)
        return {k: max(g[k] for g in gathered) for k in local}

    def raw_copy(self) -> dict[str, float]:
        start = time.perf_counter()
        offset = 0
        for t in self.shards:
            n = t.numel() * t.element_size()
            self.raw[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += n
        return {"raw_copy": time.perf_counter() - start}

    def flash(self) -> dict[str, float]:
        self.step += 1
        start = time.perf_counter()
        result = self.flash_dcp.save(self.ck, self.step, self.state)
        blocking = time.perf_counter() - start
        outcome = result.wait()
        if not outcome.committed:
            raise RuntimeError(f"flash step {self.step} was not committed: {outcome.error}")
        return {"flash_blocking": blocking, "flash_committed": time.perf_counter() - start}

    def folder(self, name: str) -> str:
        return os.path.join(self.root, f"{name}-{self.step}-{uuid.uuid4().hex[:6]}" if self.rank == 0 else "")

    def dcp_save(self) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        path = self.broadcast(self.folder("dcp"))
        start = time.perf_counter()
        dcp.save(self.state, checkpoint_id=path)
        return {"dcp.save": time.perf_counter() - start}

    def async_save(self, kind: str) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self.broadcast(self.folder(kind))
        start = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType(kind))
        blocking = time.perf_counter() - start
        future.result()
        return {f"async_{kind}": blocking, f"async_{kind}_done": time.perf_counter() - start}

    def run(self) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {}
        for repeat in range(self.args.repeats + 1):
            # raw_copy and the flash save swap places every repeat: neither always runs first.
            pair = (self.raw_copy, self.flash) if repeat % 2 else (self.flash, self.raw_copy)
            fns = [*pair, self.dcp_save]
            if not self.args.skip_async:
                fns += [lambda: self.async_save("thread"), lambda: self.async_save("process")]
            for fn in fns:
                for key, value in self.timed(fn).items():
                    if repeat > 0:
                        samples.setdefault(key, []).append(value)
            if self.rank == 0:
                shutil.rmtree(self.root + "/flash-tmp", ignore_errors=True)
                for name in os.listdir(self.root):
                    if name != "flash":
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            self.dist.barrier()
        return samples

    def close(self) -> None:
        self.ck.close()
        os.unlink(self.shm_path)
        self.dist.barrier()
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        self.dist.destroy_process_group()


def table(samples: dict[str, list[float]], nbytes: int, args: argparse.Namespace) -> str:
    med = {k: statistics.median(v) for k, v in samples.items()}

    def paired(key: str, base: str) -> float:
        """Median over repeats of key/base within the same repeat (robust to the machine's drift)."""
        return statistics.median(a / b for a, b in zip(samples[key], samples[base]))

    lines = [f"sharded state: {args.gib:g} GiB in {args.tensors} DTensors over {args.nproc} ranks "
             f"({nbytes / GIB:.3f} GiB per rank); {args.repeats} repeats; files under {args.dir}",
             "", "x columns: median over repeats of the ratio within a repeat",
             "", "| metric | median s | min s | x raw_copy | x dcp.save |", "|---|---|---|---|---|"]
    for key in ("raw_copy", "flash_blocking", "flash_committed", "dcp.save", "async_thread", "async_thread_done",
                "async_process", "async_process_done"):
        if key in samples:
            lines.append(f"| {key} | {med[key]:.3f} | {min(samples[key]):.3f} | {paired(key, 'raw_copy'):.2f} | "
                         f"{paired(key, 'dcp.save'):.2f} |")
    blocking = paired("flash_blocking", "raw_copy")
    committed = paired("flash_committed", "dcp.save")
    lines += ["", f"target flash_blocking <= 1.2x raw_copy: {blocking:.2f}x {'PASS' if blocking <= 1.2 else 'FAIL'}",
              f"target flash_committed <= dcp.save: {committed:.2f}x {'PASS' if committed <= 1.0 else 'FAIL'}"]
    return "\n".join(lines)


def main() -> int:
    args = parse()
    if not os.environ.get("FLASHCKPT_BENCH_WORKER"):
        return launch(args)
    import logging

    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    bench = Bench(args)
    try:
        samples = bench.run()
    finally:
        bench.close()
    if bench.rank == 0:
        print(table(samples, bench.nbytes, args), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(samples, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
