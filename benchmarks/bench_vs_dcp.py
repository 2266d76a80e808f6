#!/usr/bin/env python3
"""Ours (engine API and DCP adapter) against ``dcp.async_save`` with the process executor and a
shared-memory ``DefaultStager`` (what a torchtitan user has), and against the physical limits:
saves, restores from storage, and memory, side by side in one run.

    python benchmarks/bench_vs_dcp.py                  # 1 GiB in 433 float32 tensors, 3 repeats (~4 min)
    python benchmarks/bench_vs_dcp.py --gib 4          # needs about 4x the state in free memory (~15 min)
    python benchmarks/bench_vs_dcp.py --dir /mnt/nvme --json out.json

Every measurement runs in a fresh worker process (one torch thread; DCP and the DCP adapter in a
gloo group of one rank), so each system's first save is a job's first save. A repeat runs the
four save workers, ``raw``, ``engine``, ``flash_dcp`` and ``dcp``, in an order reversed every
other repeat. Saves measured against the warm copy are each paired with a warm raw copy of the
same state in the same process, right before or after it (alternated); the other ratios are taken
against that repeat's ``raw`` worker. The table gives medians over repeats of the ratios within a
repeat. Before every timed call: ``os.sync()`` and a ``--settle`` pause.

What each row times, for the raw limit / ours (``engine`` and ``flash_dcp``) / ``dcp``:

- first save: a copy into a fresh, sparse ``/dev/shm`` mapping (the cold copy) / the first
  ``save`` of a new job without ``prepare()`` / the first ``async_save`` call (its stager and
  executor process made then).
- prepare: a cold copy into each of two fresh mappings, in the same process just before (the
  memory in use as when the slots are made) / ``prepare(state)`` (engine API).
- first save after prepare: a copy into a warm mapping (the warm copy) / the first ``save``
  after ``prepare()`` (engine API).
- warm memory save: the warm copy / ``save(..., persist=False)``, median of 3.
- persisting save, blocking part: the warm copy / ``save(..., persist=True)`` until it returns /
  ``async_save`` until its staging is done (the state may change then), median of 3 after the first.
- call to committed: ``torch.save`` + fsync / that save until committed (fsynced) / until the
  upload future completes.
- shared memory: the peak of ``Shmem`` (``/proc/meminfo``) above what it was before the job.
- extra memory: the peak of that shared memory plus the private anonymous memory (``RssAnon``)
  the trainer process added and its helper processes hold (our saver; DCP's executor process).

Restores from storage run once in their own worker (``bench_restore.Bench``, every row once per
repeat, order alternated, page cache dropped for the uncached rows): ``odirect_read`` (the disk),
``engine`` and ``flash_dcp`` (ours, ``prefer_memory=False``), ``dcp_load`` (stock), and the
``_cached`` rows: the same files in the page cache, which is where a restore right after a save
reads when files are written buffered (``FLASHCKPT_DIRECT_IO=0``, and DCP) rather than with
``O_DIRECT`` (our default).

Targets: restore from storage <= 1.3x ``odirect_read`` (both our paths); first save after
``prepare()`` <= 1.1x the warm copy; the blocking part of a persisting save <= 1.05x the warm copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_vs_dlrover import Raw, held_bytes, make_state, timed  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
SYSTEMS = ["raw", "engine", "flash_dcp", "dcp"]
WARM_SAVES = 3
RESTORE_ROWS = ["odirect_read", "engine", "engine_cached", "flash_dcp", "dcp_load", "dcp_load_cached"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the state")
    parser.add_argument("--tensors", type=int, default=433)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.5, help="pause (s) after os.sync() before each timed call")
    parser.add_argument("--dir", default="/tmp", help="where checkpoints are written (a local disk, not tmpfs)")
    parser.add_argument("--json", default=None, help="also write every sample here")
    parser.add_argument("--skip-restore", action="store_true", help="leave out the restores from storage")
    parser.add_argument("--systems", default=",".join(SYSTEMS[1:]),
                        help="which of engine, flash_dcp, dcp to run (the raw worker always runs)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


# --- in a worker -------------------------------------------------------------------------------


def shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_anon(pid: int) -> int:
    """A process's private anonymous memory (``RssAnon``: shared memory is counted apart)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


class MemoryPeak:
    """The peak memory a job adds to the state it checkpoints: shared memory (``Shmem`` of
    ``/proc/meminfo``) above what it was at the start, plus the private anonymous memory of this
    process above its start and of its helper processes (descendants, and ``helpers()``: a saver
    that is not a child), less ``excluded()`` (the benchmark's own mapping). Sampled every 10 ms
    (process list every 0.2 s)."""

    def __init__(self, helpers: Callable[[], list[int]] = list, excluded: Callable[[], int] = int) -> None:
        self.helpers, self.excluded = helpers, excluded
        self.base_shm, self.base_anon = shmem(), rss_anon(os.getpid())
        self.extra = self.shm = 0
        self._pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me, tick = os.getpid(), 0
        while not self._stop.wait(0.01):
            if tick % 20 == 0:
                self._pids = descendants(me) | set(self.helpers())
            tick += 1
            shm = shmem() - self.base_shm - self.excluded()
            anon = rss_anon(me) - self.base_anon + sum(rss_anon(pid) for pid in self._pids)
            self.shm, self.extra = max(self.shm, shm), max(self.extra, shm + anon)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.extra, self.shm


class RawCopy(Raw):
    """``bench_vs_dlrover``'s raw limit as a call: ``.copy_`` of every tensor into slices of one
    ``/dev/shm`` mapping, 64-byte aligned (the first call maps it fresh and faults it in: a cold
    copy; later ones are warm)."""

    def __init__(self, state: dict[str, Any], shm_dir: str) -> None:
        super().__init__({"shm_dir": shm_dir, "job": uuid.uuid4().hex, "dir": shm_dir})
        self.state = state

    def __call__(self) -> None:
        self.save_memory(0, self.state)

    def held(self) -> int:
        """Bytes of memory the mapping's file holds (its pages written so far)."""
        return held_bytes(self.shm_paths())


class Worker:
    def __init__(self, args: argparse.Namespace, build: bool) -> None:
        import torch

        torch.set_num_threads(1)
        self.args, self.torch = args, torch
        self.state = make_state(args.gib * 1024, args.tensors, seed=0) if build else {}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.root = tempfile.mkdtemp(prefix="bench-vs-dcp-", dir=args.dir)
        self.shm_dir = tempfile.mkdtemp(prefix="flashckpt-bench-", dir="/dev/shm")
        self.out: dict[str, Any] = {"state_bytes": self.nbytes}

    def quiet(self) -> None:
        os.sync()
        time.sleep(self.args.settle)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    # raw: the limits
    def raw(self) -> None:
        copy = RawCopy(self.state, self.shm_dir)
        self.quiet()
        self.out["cold_copy"] = timed(copy)[0]
        warm = []
        for _ in range(WARM_SAVES):
            self.quiet()
            warm.append(timed(copy)[0])
        self.out["warm_copy"] = statistics.median(warm)
        copy.close()
        self.quiet()
        path = os.path.join(self.root, "raw.pt")

        def save_fsync() -> None:
            with open(path, "wb") as f:
                self.torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())

        self.out["committed"] = timed(save_fsync)[0]

    def paired(self, name: str, copy: RawCopy, call: Callable[[], Any], first: bool) -> Any:
        """Time ``call`` and a warm raw copy of the same state in this process, one right after the
        other (``first``: the raw copy first): ``name`` and ``name + "_raw"``."""
        out = None
        for which in ("raw", "call") if first else ("call", "raw"):
            self.quiet()
            if which == "raw":
                self.out.setdefault(name + "_raw", []).append(timed(copy)[0])
            else:
                seconds, out = timed(call)
                self.out.setdefault(name, []).append(seconds)
        return out

    # ours, through the engine API or the DCP adapter
    def ours(self, dcp_adapter: bool) -> None:
        from flashckpt_integrations import Checkpointer, SaveStatus
        from flashckpt_integrations.adapters import dcp as flash_dcp

        def new(name: str) -> Any:
            url = os.path.join(self.root, name)
            if dcp_adapter:
                ck = Checkpointer(url, flash_dcp.checkpointer_config(shm_dir=self.shm_dir), job_id=name)
            else:
                ck = Checkpointer(url, shm_dir=self.shm_dir, job_id=name)
            ck.client.connect()
            ck.client.request({"op": "ping"}).result(60)  # the saver is up before anything is timed
            return ck

        def save(ck: Any, step: int, persist: bool) -> Any:
            if dcp_adapter:
                r = flash_dcp.save(ck, step, {"model": self.state}, persist=persist)
            else:
                r = ck.save(step, self.state, persist=persist)
            want = SaveStatus.PERSISTING if persist else SaveStatus.IN_MEMORY
            if r.status is not want:
                raise RuntimeError(f"save of step {step}: {r.status} {r.reason}")
            return r

        if not dcp_adapter:  # what prepare() is measured against: a cold copy into each of two fresh
            first, second = RawCopy(self.state, self.shm_dir), RawCopy(self.state, self.shm_dir)  # mappings
            self.quiet()
            cold = timed(first)[0]
            self.quiet()
            cold += timed(second)[0]
            first.close()
            second.close()
            self.out["prepare_raw"] = [cold]
        copy = RawCopy(self.state, self.shm_dir)  # made warm after prepare(), which then runs with the
        saver: list[int] = []  # memory in use that its baseline ran with (this VM faults pages in
        peak = MemoryPeak(lambda: saver, excluded=copy.held)  # slower as that grows)
        ck = new("main")
        saver.append(ck.client.saver_pid or 0)
        if not dcp_adapter:
            self.quiet()
            self.out["prepare"] = [timed(lambda: ck.prepare(self.state))[0]]
            copy()
            self.paired("first_save_prepared", copy, lambda: save(ck, 1, persist=False), first=True)
        else:
            copy()
            self.quiet()
            self.out["first_save"] = timed(lambda: save(ck, 1, persist=False))[0]
        for step in (2, 3):  # untimed: both slots written once
            save(ck, step, persist=False)
            ck.wait_for_snapshot()
        for i, step in enumerate(range(4, 4 + WARM_SAVES)):
            self.paired("warm_save", copy, lambda s=step: save(ck, s, persist=False), first=i % 2 == 0)
        for step in range(10, 10 + WARM_SAVES):
            r = self.paired("persist_blocking", copy, lambda s=step: save(ck, s, persist=True), first=True)
            returned = time.perf_counter()
            if not r.wait(600).committed:
                raise RuntimeError(f"step {step} was not committed")
            blocking = self.out["persist_blocking"][-1]
            self.out.setdefault("committed", []).append(blocking + time.perf_counter() - returned)
        self.out["extra_memory"], self.out["shared_memory"] = peak.stop()
        copy.close()
        run_dir = ck.run_dir
        ck.close()
        if not dcp_adapter:  # a job's first save without prepare(), in a new job
            cold = new("cold")
            self.quiet()
            self.out["first_save"] = timed(lambda: save(cold, 1, persist=False))[0]
            cold.close()
        from tests.helpers import kill_savers

        kill_savers(run_dir)

    def dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        copy = RawCopy(self.state, self.shm_dir)
        copy()
        peak = MemoryPeak()
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=False))

        def async_save(step: int) -> Any:
            response = dcp.async_save({"model": self.state}, checkpoint_id=os.path.join(self.root, f"step-{step}"),
                                      async_stager=stager, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            staged = getattr(response, "staging_completion", None)
            if staged is not None:  # the state may change once staging is done: the blocking part
                staged.result()
            return getattr(response, "upload_completion", response)

        self.quiet()
        start = time.perf_counter()
        upload = async_save(0)
        self.out["first_save"] = time.perf_counter() - start
        upload.result()
        for step in range(1, 1 + WARM_SAVES):
            upload = self.paired("persist_blocking", copy, lambda s=step: async_save(s), first=True)
            returned = time.perf_counter()
            upload.result()
            blocking = self.out["persist_blocking"][-1]
            self.out.setdefault("committed", []).append(blocking + time.perf_counter() - returned)
        self.out["extra_memory"], self.out["shared_memory"] = peak.stop()
        stager.close()
        copy.close()

    def restore(self) -> None:
        import bench_restore

        bench = bench_restore.Bench(argparse.Namespace(gib=self.args.gib, tensors=self.args.tensors,
                                                       dir=self.args.dir))
        samples: dict[str, list[float]] = {row: [] for row in RESTORE_ROWS}
        try:
            for repeat in range(self.args.repeats):
                for row in (RESTORE_ROWS if repeat % 2 == 0 else RESTORE_ROWS[::-1]):
                    samples[row].append(bench.run_row(row))
        finally:
            bench.close()
        self.out["restore"] = samples


def worker(args: argparse.Namespace) -> int:
    import logging
    import warnings

    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    w = Worker(args, build=args.worker != "restore")
    try:
        if args.worker in ("flash_dcp", "dcp"):
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{w.root}/store", rank=0, world_size=1)
        if args.worker == "raw":
            w.raw()
        elif args.worker in ("engine", "flash_dcp"):
            w.ours(dcp_adapter=args.worker == "flash_dcp")
        elif args.worker == "dcp":
            w.dcp()
        else:
            w.restore()
    finally:
        w.close()
    print("RESULT " + json.dumps(w.out), flush=True)
    return 0


# --- the parent ----------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace, system: str) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", system, "--gib", str(args.gib),
               "--tensors", str(args.tensors), "--repeats", str(args.repeats), "--settle", str(args.settle),
               "--dir", args.dir]
    env = {**os.environ, "FLASHCKPT_RUN_DIR": tempfile.mkdtemp(prefix="bench-vs-dcp-run-")}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        shutil.rmtree(env["FLASHCKPT_RUN_DIR"], ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker {system} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


ROWS: list[tuple[str, str, str, str]] = [
    # (label, our key, dcp key, the raw key it is divided by)
    ("first save of a job (no prepare)", "first_save", "first_save", "cold_copy"),
    ("prepare() / two cold copies", "prepare", "", "prepare_raw"),
    ("first save after prepare()", "first_save_prepared", "", "warm_copy"),
    ("warm memory save", "warm_save", "", "warm_copy"),
    ("persisting save, blocking part", "persist_blocking", "persist_blocking", "warm_copy"),
    ("call to committed (fsynced)", "committed", "committed", "committed"),
]


def value(sample: Any) -> float:
    return statistics.median(sample) if isinstance(sample, list) else sample


def ratio(repeats: list[dict[str, dict[str, Any]]], system: str, key: str, base: str) -> float | None:
    """Median over repeats of ``key`` over its limit in the same repeat: the raw copies paired with it
    in its own process where it has them, else the ``raw`` worker's ``base``."""
    values = []
    for rep in repeats:
        got = rep.get(system, {}).get(key)
        if got is None:
            return None
        paired = rep[system].get(key + "_raw")
        if paired is not None:
            values.append(statistics.median(a / b for a, b in zip(got, paired)))
            continue
        values.append(value(got) / rep["raw"][base])
    return statistics.median(values)


def median(repeats: list[dict[str, dict[str, Any]]], system: str, key: str) -> float | None:
    values = [rep.get(system, {}).get(key) for rep in repeats]
    return statistics.median(value(v) for v in values) if values and None not in values else None


def table(repeats: list[dict[str, dict[str, Any]]], restore: dict[str, list[float]] | None, gib: float) -> str:
    nbytes = repeats[0]["raw"]["state_bytes"]
    lines = [f"{nbytes / GIB:.2f} GiB in float32 tensors, {len(repeats)} repeats, order alternated; "
             "s: median; x: median over repeats of the ratio to the raw limit in the same repeat", "",
             "| row | raw (limit) | engine API | x | DCP adapter | x | dcp.async_save | x |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(system: str, key: str, base: str) -> str:
        got = median(repeats, system, key) if key else None
        if got is None:
            return "- | -"
        x = ratio(repeats, system, key, base)
        return f"{got:.3f} s | {x:.2f}x" if x is not None else f"{got:.3f} s | -"

    for label, ours, theirs, base in ROWS:
        if ours + "_raw" in repeats[0].get("engine", {}) and base != "warm_copy":  # measured beside it
            raw_text = f"{median(repeats, 'engine', ours + '_raw'):.3f} s"
        else:
            raw_text = f"{median(repeats, 'raw', base):.3f} s"
        lines.append(f"| {label} | {raw_text} | {cell('engine', ours, base)} | {cell('flash_dcp', ours, base)} | "
                     f"{cell('dcp', theirs, base)} |")
    for label, key in (("shared memory, peak", "shared_memory"), ("extra memory, peak", "extra_memory")):
        cells = []
        for system in ("engine", "flash_dcp", "dcp"):
            if system not in repeats[0]:
                cells.append("- | -")
                continue
            x = statistics.median(rep[system][key] / rep[system]["state_bytes"] for rep in repeats)
            cells.append(f"{x:.2f}x the state | -")
        lines.append(f"| {label} | 1.00x | " + " | ".join(cells) + " |")
    targets = [("first save after prepare() <= 1.1x the warm copy", ratio(repeats, "engine", "first_save_prepared",
                                                                          "warm_copy"), 1.1),
               ("engine: persisting save's blocking part <= 1.05x the warm copy",
                ratio(repeats, "engine", "persist_blocking", "warm_copy"), 1.05),
               ("DCP adapter: persisting save's blocking part <= 1.05x the warm copy",
                ratio(repeats, "flash_dcp", "persist_blocking", "warm_copy"), 1.05)]
    if restore is not None:
        lines += ["", "| restore from storage into live tensors | median s | GB/s | x odirect_read | x dcp_load |",
                  "|---|---|---|---|---|"]
        for row in RESTORE_ROWS:
            med = statistics.median(restore[row])
            x = statistics.median(a / b for a, b in zip(restore[row], restore["odirect_read"]))
            y = statistics.median(a / b for a, b in zip(restore[row], restore["dcp_load"]))
            lines.append(f"| {row} | {med:.3f} | {nbytes / med / 1e9:.2f} | {x:.2f} | {y:.2f} |")
        for row in ("engine", "flash_dcp"):
            x = statistics.median(a / b for a, b in zip(restore[row], restore["odirect_read"]))
            targets.append((f"restore from storage, {row} <= 1.3x odirect_read", x, 1.3))
    lines.append("")
    for label, x, limit in targets:
        if x is not None:
            lines.append(f"target {label}: {x:.2f}x {'PASS' if x <= limit else 'FAIL'}")
    return "\n".join(lines)


def main() -> int:
    args = parse()
    if args.worker:
        return worker(args)
    repeats: list[dict[str, dict[str, Any]]] = []
    for repeat in range(args.repeats):
        chosen = ["raw"] + [system for system in SYSTEMS[1:] if system in args.systems.split(",")]
        order = chosen if repeat % 2 == 0 else chosen[::-1]
        repeats.append({system: run_worker(args, system) for system in order})
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    restore = None if args.skip_restore else run_worker(args, "restore")["restore"]
    print(table(repeats, restore, args.gib), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "tensors": args.tensors, "repeats": repeats, "restore": restore}, f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
