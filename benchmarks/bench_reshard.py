#!/usr/bin/env python3
"""Restoring DCP state onto fewer ranks from shared memory, against storage and a same-world restore.

    python benchmarks/bench_reshard.py                       # 256 MiB per saving rank (1 GiB), 3 repeats
    python benchmarks/bench_reshard.py --mib-per-rank 512 --repeats 5 --json out.json
    python benchmarks/bench_reshard.py --quick               # tiny state, 1 repeat: checks the script works
    python benchmarks/bench_reshard.py --profile prof/       # also cProfile rank 0's load in the memory rows

The state is a model of ``--layers`` square ``nn.Linear`` layers (weights and biases, float32),
``fully_shard`` (FSDP2) per layer and at the root, ``4 x --mib-per-rank`` in total: 256 MiB per rank
when 4 ranks hold it, 512 MiB per rank when 2 do. No optimizer. Every job runs under torchrun with
gloo on the CPU, one torch thread per rank, and ``FLASHCKPT_SHM_DIR`` / ``FLASHCKPT_RUN_DIR`` private
to the repeat (removed afterwards, the savers killed).

Each repeat makes a fresh checkpoint directory and two checkpoints in it:

* ``ckpt4``: a job of 4 ranks fills the model, ``flash_dcp.save(ck, 1, state, persist=True)``, waits
  for the commit and SIGKILLs itself (its shared-memory snapshots stay, as after a crash);
* ``ckpt2``: the same with 2 ranks.

Then a new job of 2 ranks per row restores the state into zeroed, resident live tensors. A row's
time is the ``flash_dcp.load`` call, timed on every rank after a barrier, the slowest rank's:

| row | what the 2-rank job restores |
|---|---|
| ``reshard_memory`` | ``ckpt4`` from the 4 old ranks' snapshots in memory (``flash_dcp.load(ck, state)``) |
| ``storage_cold`` | ``ckpt4`` from its committed files (``prefer_memory=False``), page cache dropped first |
| ``storage_warm`` | the same with the files read once just before (in the page cache) |
| ``same_world_memory`` | ``ckpt2`` from its own 2 ranks' snapshots in memory |

The rows' order rotates by one place every repeat, and each starts after ``os.sync()`` and a
``--settle`` pause. Every restore is checked against the saved state (per tensor: the sum and a
row-weighted sum, in float64), and its source (and, for ``reshard_memory``, the adapter's
"resharded ... onto 2 ranks" log line) against the row. Ratios are medians over repeats of the ratio
within a repeat. Targets: ``reshard_memory`` <= 1.5x ``same_world_memory`` and <= 0.5x
``storage_cold``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.helpers import kill_savers  # noqa: E402

MIB = 1 << 20
ROWS = ("reshard_memory", "storage_cold", "storage_warm", "same_world_memory")
STEP = 1


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib-per-rank", type=int, default=256,
                        help="state per rank of the 4-rank job that saves, MiB (default 256: 1 GiB in all)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; each row runs once per repeat (default 3)")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers of the model (default 16)")
    parser.add_argument("--dir", default="/tmp", help="where checkpoints are written (a local disk; default /tmp)")
    parser.add_argument("--shm-base", default="/dev/shm", help="where the private shared-memory directory is made")
    parser.add_argument("--settle", type=float, default=1.0, help="pause (s) after os.sync() before each row")
    parser.add_argument("--quick", action="store_true", help="4 MiB per rank, 1 repeat, no settle: a smoke test")
    parser.add_argument("--profile", default=None,
                        help="directory for cProfile stats of rank 0's load in the memory rows (printed at the end)")
    parser.add_argument("--json", default=None, help="also write every sample here")
    parser.add_argument("--keep", action="store_true", help="keep the work directories (job logs, checkpoints)")
    # the worker (run under torchrun)
    parser.add_argument("--worker", choices=("save", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefer-storage", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib_per_rank, args.repeats, args.settle = 4, 1, 0.0
    return args


def width_for(mib_per_rank: int, layers: int) -> int:
    """The layers' width for ``4 x mib_per_rank`` of weights; a multiple of 8, so 4 and 2 ranks shard evenly."""
    return max(8, int(math.sqrt(4 * mib_per_rank * MIB / 4 / layers)) // 8 * 8)


# --- the workers (run under torchrun) ----------------------------------------------------------------


def build(width: int, layers: int, fill: bool) -> Any:
    """The FSDP2 model, made on the meta device and materialized shard by shard (no rank ever holds
    the whole model); ``fill``: seeded values per shard, else zeros (faulted in: resident, as live
    tensors are)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            local = param._local_tensor
            if fill:
                _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                gen = torch.Generator().manual_seed(index * 1_000_003 + offset[0])
                local.uniform_(-1.0, 1.0, generator=gen)
            else:
                local.zero_()
    return model


def fingerprint(model: Any) -> list[float]:
    """Per parameter, over the whole (sharded) tensor: its sum and the sum of its rows' sums weighted
    by their global row index (a collective). Equal before the save and after the restore, whatever
    the sharding, unless a value or a row moved."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    parts = []
    for param in model.parameters():
        local = param._local_tensor.detach()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        rows = local.reshape(local.shape[0], -1).sum(dim=1, dtype=torch.float64)
        weights = torch.arange(offset[0] + 1, offset[0] + 1 + rows.numel(), dtype=torch.float64)
        parts += [rows.sum(), (rows * weights).sum()]
    total = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


def write_json(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def worker_save(args: argparse.Namespace) -> None:
    """Fill, save with persist=True, wait for the commit, then SIGKILL every rank (the snapshots stay)."""
    import torch.distributed as dist

    from flashckpt_integrations import Checkpointer
    from flashckpt_integrations.adapters import dcp as flash_dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.width, args.layers, fill=True)
    state = {"model": model}
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config(commit_timeout_s=600))
    dist.barrier()
    started = time.perf_counter()
    result = flash_dcp.save(ck, STEP, state, persist=True)
    blocking = time.perf_counter() - started
    outcome = result.wait()
    if not outcome.committed:
        raise RuntimeError(f"rank {rank}: step {STEP} was not committed: {outcome.error}")
    committed = time.perf_counter() - started
    sums = fingerprint(model)
    record = {"blocking_s": blocking, "committed_s": committed, "pid": os.getpid(), "run_dir": ck.run_dir}
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if rank == 0:
        write_json(os.path.join(args.out, "saved.json"), {"ranks": records, "sums": sums})
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: the slots are left for the restart


def worker_restore(args: argparse.Namespace) -> None:
    """Restore into zeroed live tensors; time ``flash_dcp.load`` on every rank after a barrier."""
    import torch.distributed as dist

    from flashckpt_integrations import Checkpointer
    from flashckpt_integrations.adapters import dcp as flash_dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.width, args.layers, fill=False)
    state = {"model": model}
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config())
    ck.client.connect()  # the node's saver answers (a real job starts it at the Checkpointer, off the clock)
    gc.collect()
    profiler = None
    if args.profile_to and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    dist.barrier()
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    loaded = flash_dcp.load(ck, state, prefer_memory=not args.prefer_storage)
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - started
    if profiler is not None:
        profiler.dump_stats(args.profile_to)
    sums = fingerprint(model)
    record = {"seconds": seconds, "step": loaded and loaded.step, "source": loaded and loaded.source}
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if rank == 0:
        write_json(os.path.join(args.out, "restored.json"), {"ranks": records, "sums": sums})
    ck.shutdown(clean=False)  # keep the shared memory: the other rows of the repeat read it too
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown, where gloo threads still running can abort it


def worker(args: argparse.Namespace) -> None:
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    os.makedirs(args.out, exist_ok=True)
    if args.worker == "save":
        worker_save(args)
    else:
        worker_restore(args)


# --- the orchestrator -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Repeat:
    """One repeat's directories, environment and jobs; ``close`` kills its savers and removes them."""

    def __init__(self, args: argparse.Namespace, index: int) -> None:
        self.args = args
        self.index = index
        self.width = width_for(args.mib_per_rank, args.layers)
        self.base = tempfile.mkdtemp(prefix=f"bench-reshard-{index}-", dir=args.dir)
        self.shm = tempfile.mkdtemp(prefix="bench-reshard-", dir=args.shm_base)
        self.run = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: the saver's socket path is under it
        self.env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_SHM_DIR": self.shm,
                    "FLASHCKPT_RUN_DIR": self.run}
        self.jobs = 0
        self.job_s = 0.0

    def torchrun(self, nproc: int, role: str, ckpt: str, *extra: str) -> tuple[int, str, str]:
        """Run one job; (its exit status, its output folder, its log)."""
        self.jobs += 1
        out = os.path.join(self.base, f"job{self.jobs}-{role}-{os.path.basename(ckpt)}")
        os.makedirs(out)
        log = os.path.join(out, "log.txt")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", os.path.abspath(__file__), "--worker", role, "--ckpt", ckpt,
               "--out", out, "--width", str(self.width), "--layers", str(self.args.layers), *extra]
        started = time.monotonic()
        with open(log, "w") as f:
            code = subprocess.call(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   timeout=1800)
        self.job_s = time.monotonic() - started
        return code, out, log

    def save(self, nproc: int) -> dict[str, Any]:
        ckpt = os.path.join(self.base, f"ckpt{nproc}")
        code, out, log = self.torchrun(nproc, "save", ckpt)
        path = os.path.join(out, "saved.json")
        if not os.path.exists(path):  # (the job ends by SIGKILL: its exit status is not 0)
            raise RuntimeError(f"the {nproc}-rank save failed (exit {code}):\n{tail(log)}")
        with open(path) as f:
            saved = json.load(f)
        saved["ckpt"] = ckpt
        return saved

    def restore(self, row: str, saved: dict[str, Any]) -> dict[str, Any]:
        ckpt = saved["ckpt"]
        if row.startswith("storage"):
            files = checkpoint_files(ckpt)
            drop(files)
            if row == "storage_warm":
                read_all(files)
        settle(self.args.settle)
        share = cached_share(checkpoint_files(ckpt)) if row.startswith("storage") else None
        extra = ["--prefer-storage"] if row.startswith("storage") else []
        if self.args.profile and row.endswith("memory"):
            os.makedirs(self.args.profile, exist_ok=True)
            extra += ["--profile-to", os.path.abspath(os.path.join(self.args.profile, f"{row}-{self.index}.pstats"))]
        code, out, log = self.torchrun(2, "restore", ckpt, *extra)
        path = os.path.join(out, "restored.json")
        if code != 0 or not os.path.exists(path):
            raise RuntimeError(f"the {row} restore failed (exit {code}):\n{tail(log)}")
        with open(path) as f:
            restored = json.load(f)
        check(row, restored, saved, log)
        return {"seconds": max(r["seconds"] for r in restored["ranks"]),
                "ranks": [r["seconds"] for r in restored["ranks"]], "cached_share": share, "job_s": self.job_s}

    def close(self) -> None:
        kill_savers(self.run)  # (every saver's run directory is under the repeat's FLASHCKPT_RUN_DIR)
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.run, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def check(row: str, restored: dict[str, Any], saved: dict[str, Any], log: str) -> None:
    """The restore came from where the row says, and equals what was saved."""
    want = "storage" if row.startswith("storage") else "memory"
    sources = {(r["step"], r["source"]) for r in restored["ranks"]}
    if sources != {(STEP, want)}:
        raise RuntimeError(f"{row}: restored {sorted(sources)}, expected step {STEP} from {want}:\n{tail(log)}")
    if row == "reshard_memory":
        with open(log) as f:
            if "from the memory of a job of 4 ranks onto 2 ranks" not in f.read():
                raise RuntimeError(f"{row}: no 'resharded ... onto 2 ranks' in the job's log:\n{tail(log)}")
    for got, expected in zip(restored["sums"], saved["sums"]):
        if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-6):
            raise RuntimeError(f"{row}: the restored state differs from the saved one ({got} != {expected})")
    if len(restored["sums"]) != len(saved["sums"]):
        raise RuntimeError(f"{row}: {len(restored['sums'])} sums restored, {len(saved['sums'])} saved")


def tail(path: str, chars: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def checkpoint_files(ckpt: str) -> list[str]:
    return [os.path.join(folder, name) for folder, _, names in os.walk(ckpt) for name in names]


def drop(paths: list[str]) -> None:
    """fsync every file, then drop its clean pages from the page cache."""
    from flashckpt_integrations._utils import pagecache

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            pagecache.drop(fd)
        finally:
            os.close(fd)


def read_all(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(8 * MIB):
                pass


def cached_share(paths: list[str]) -> float:
    """The share of the files' bytes in the page cache (sampled by ``mincore``)."""
    from flashckpt_integrations._utils import pagecache

    held = total = 0.0
    for path in paths:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            share = pagecache.cached_share(fd, size)
        finally:
            os.close(fd)
        held += (share or 0.0) * size
        total += size
    return held / total if total else 0.0


def settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    saves: dict[str, list[dict[str, Any]]] = {"4 ranks": [], "2 ranks": []}
    for index in range(args.repeats):
        order = ROWS[index % len(ROWS):] + ROWS[:index % len(ROWS)]
        repeat = Repeat(args, index)
        try:
            saved4, saved2 = repeat.save(4), repeat.save(2)
            saves["4 ranks"].append(saved4)
            saves["2 ranks"].append(saved2)
            for row in order:
                result = repeat.restore(row, saved2 if row == "same_world_memory" else saved4)
                samples[row].append(result)
                print(f"repeat {index + 1}/{args.repeats} {row}: {result['seconds']:.3f} s (ranks: "
                      + ", ".join(f"{s:.3f}" for s in result["ranks"])
                      + (f"; page cache {result['cached_share']:.0%}" if result["cached_share"] is not None else "")
                      + f"; the whole job {result['job_s']:.1f} s)", flush=True)
        finally:
            repeat.close()
    return {"samples": samples, "saves": saves}


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    samples = {row: [s["seconds"] for s in results["samples"][row]] for row in ROWS}
    width = width_for(args.mib_per_rank, args.layers)
    total = args.layers * (width * width + width) * 4

    def paired(key: str, base: str) -> float:
        """Median over repeats of key/base within the same repeat (robust to the machine's drift)."""
        return statistics.median(a / b for a, b in zip(samples[key], samples[base]))

    cores = len(os.sched_getaffinity(0))
    lines = [f"state: {args.layers} x Linear({width}, {width}) float32, {total / MIB:.0f} MiB: "
             f"{total / 4 / MIB:.0f} MiB per saving rank (4 ranks), {total / 2 / MIB:.0f} MiB per restoring rank "
             f"(2 ranks); FSDP2, gloo, CPU, {cores} cores; {args.repeats} repeats; files under {args.dir}",
             "", "x columns: median over repeats of the ratio within a repeat", "",
             "| row | median s | min s | max s | x same_world_memory | x storage_cold |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in ROWS:
        values = samples[row]
        lines.append(f"| {row} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | "
                     f"{paired(row, 'same_world_memory'):.2f} | {paired(row, 'storage_cold'):.2f} |")
    save_lines = []
    for key, runs in results["saves"].items():
        blocking = statistics.median(max(r["blocking_s"] for r in run["ranks"]) for run in runs)
        committed = statistics.median(max(r["committed_s"] for r in run["ranks"]) for run in runs)
        save_lines.append(f"save by {key}: blocking {blocking:.3f} s, committed {committed:.3f} s (medians)")
    same = paired("reshard_memory", "same_world_memory")
    cold = paired("reshard_memory", "storage_cold")
    lines += ["", *save_lines, "",
              f"target reshard_memory <= 1.5x same_world_memory: {same:.2f}x {'PASS' if same <= 1.5 else 'FAIL'}",
              f"target reshard_memory <= 0.5x storage_cold: {cold:.2f}x {'PASS' if cold <= 0.5 else 'FAIL'}"]
    return "\n".join(lines)


def profiles(directory: str, limit: int = 30) -> str:
    import io
    import pstats

    out = io.StringIO()
    for row in ("reshard_memory", "same_world_memory"):
        paths = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(row))
        if not paths:
            continue
        stats = pstats.Stats(*paths, stream=out)
        out.write(f"\n=== {row}: rank 0's flash_dcp.load, {len(paths)} run(s), by cumulative time ===\n")
        stats.sort_stats("cumulative").print_stats(limit)
        out.write(f"\n=== {row}: by own time ===\n")
        stats.sort_stats("tottime").print_stats(limit // 2)
    return out.getvalue()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    started = time.monotonic()
    results = run(args)
    print()
    print(table(results, args), flush=True)
    if args.profile:
        print(profiles(args.profile), flush=True)
    print(f"\n{args.repeats} repeats in {time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith(("worker", "ckpt", "out"))},
                       **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
