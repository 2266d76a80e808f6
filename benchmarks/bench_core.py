#!/usr/bin/env python3
"""Benchmark of the flashckpt core engine against the memory-copy limit and PyTorch baselines.

Single process, CPU tensors. Every metric is measured once per repeat, round-robin, so
that all metrics see the same machine noise; the table reports medians over the repeats
and ratios to ``raw_copy`` (the cost of copying the state into a warm shared-memory buffer).

Run ``python benchmarks/bench_core.py --help`` for the options; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import mmap
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashckpt_integrations import Checkpointer, CheckpointerConfig, Layout, RetentionPolicy, SaveStatus
from flashckpt_integrations.core.engine import STATE_FILE

GIB = 1 << 30
ALIGN = 64


# --- state ---------------------------------------------------------------------------------


def make_state(gib: float, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``gib`` GiB of float32 in ``count`` tensors of log-uniformly varied sizes."""
    gen = torch.Generator().manual_seed(seed)
    total = int(gib * GIB) // 4
    weights = torch.exp(torch.empty(count, dtype=torch.float64).uniform_(0.0, math.log(2000.0), generator=gen))
    state: dict[str, torch.Tensor] = {}
    for i, w in enumerate((weights / weights.sum()).tolist()):
        numel = max(1, int(w * total))
        shape: tuple[int, ...] = (numel // 1024, 1024) if numel >= 4096 else (numel,)
        state[f"layer{i:03d}.weight"] = torch.randn(shape, generator=gen, dtype=torch.float32)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --- raw copy baseline ---------------------------------------------------------------------


class RawBuffer:
    """A warm /dev/shm mapping the state is copied into (the limit any snapshot can reach)."""

    def __init__(self, state: dict[str, torch.Tensor], shm_dir: str) -> None:
        self.offsets = []
        offset = 0
        for t in state.values():
            self.offsets.append(offset)
            offset = align(offset + t.numel() * t.element_size())
        self.size = max(offset, mmap.PAGESIZE)
        path = os.path.join(shm_dir, f"flashckpt-bench-raw-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)  # nothing is left in /dev/shm, whatever happens to this process
            os.posix_fallocate(fd, 0, self.size)
            self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.buffer.fill_(1)  # pre-touch every page (write faults)

    def copy(self, state: dict[str, torch.Tensor]) -> None:
        buf = self.buffer
        for off, t in zip(self.offsets, state.values()):
            nbytes = t.numel() * t.element_size()
            buf[off : off + nbytes].view(t.dtype).copy_(t.view(-1))

    def close(self) -> None:
        self.buffer = None
        with contextlib.suppress(BufferError):
            self.mm.close()


# --- simulated training step ---------------------------------------------------------------


class SimulatedStep:
    """A forward/backward stand-in: a matmul loop on small tensors (or a sleep) of a set length."""

    def __init__(self, mode: str, target_s: float, dim: int = 384) -> None:
        self.mode = mode
        self.target_s = target_s
        self.a = torch.randn(dim, dim)
        self.b = torch.randn(dim, dim)
        self.iters = 0
        if mode == "matmul":
            self.iters = self._calibrate()

    def _calibrate(self) -> int:
        for _ in range(20):
            torch.mm(self.a, self.b)
        t0 = time.perf_counter()
        for _ in range(50):
            torch.mm(self.a, self.b)
        self.iters = max(1, round(self.target_s / ((time.perf_counter() - t0) / 50)))
        for _ in range(2):  # then time the whole step and scale, twice
            self.rescale(statistics.median(timed(self)[0] for _ in range(3)))
        return self.iters

    def rescale(self, measured_s: float) -> None:
        """Adjust the matmul count so that the step takes ``target_s`` (given it took ``measured_s``)."""
        if self.mode == "matmul" and measured_s > 0:
            self.iters = max(1, round(self.iters * self.target_s / measured_s))

    def __call__(self) -> None:
        if self.mode == "sleep":
            time.sleep(self.target_s)
            return
        a, b = self.a, self.b
        for _ in range(self.iters):
            torch.mm(a, b)


# --- bookkeeping ---------------------------------------------------------------------------


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float | None:
        vals = self.values.get(name)
        return statistics.median(vals) if vals else None

    def min(self, name: str) -> float | None:
        vals = self.values.get(name)
        return min(vals) if vals else None


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def wait_saver_connected(ck: Checkpointer) -> None:
    """Let the background saver start (it imports torch) before anything is timed.

    The Checkpointer reaches its saver on a one-thread executor at construction; a no-op
    queued behind that returns once the connection attempt is over. Best effort: private API.
    """
    requester = getattr(ck, "_requester", None)
    if requester is not None:
        requester.submit(lambda: None).result(120)


def drop_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def filesystem_of(path: str) -> str:
    """``"<type> on <device> (<options>)"`` of the mount that holds ``path`` (Linux)."""
    path = os.path.realpath(path)
    best = ("", "?", "?", "")
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            device, mount, fstype, options = line.split()[:4]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, device, fstype, options)
    return f"{best[2]} on {best[1]} ({best[3]})"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the benchmark -------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.samples = Samples()
        self.step = 0
        self.checkpointers: list[Checkpointer] = []
        self.run_dirs: list[str] = []
        self.slot_paths: list[str] = []
        self.raw: RawBuffer | None = None
        self.dcp: Any = None
        self.dcp_process_ok = not args.skip_dcp
        self.dist_initialized = False
        self.restore_correct = True
        self.recalibrations = 0
        self.root: str | None = None
        self.shm_dir: str | None = None

    # -- setup / teardown --

    def setup(self) -> None:
        a = self.args
        base = a.dir or "/tmp"
        os.makedirs(base, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="flashckpt-bench-", dir=base)
        self.settle = a.settle
        # A private tmpfs directory for the slots: the same memory as /dev/shm itself, but out
        # of reach of anything that sweeps /dev/shm/flashckpt-<uid>-* (the test suite's fixture).
        self.shm_dir = tempfile.mkdtemp(prefix="flashckpt-bench-", dir=a.shm_base)
        t0 = time.perf_counter()
        self.state = make_state(a.gib, a.tensors)
        self.nbytes = state_bytes(self.state)
        self.reference = {k: v.clone() for k, v in self.state.items()}
        print(f"state: {len(self.state)} float32 tensors, {self.nbytes / GIB:.3f} GiB "
              f"(largest {max(t.numel() for t in self.state.values()) * 4 / 2**20:.1f} MiB, smallest "
              f"{min(t.numel() for t in self.state.values()) * 4} B), built in {time.perf_counter() - t0:.1f}s")
        fs = filesystem_of(self.root)
        print(f"dir: {self.root}: {fs}")
        if fs.startswith("tmpfs"):
            print("WARNING: --dir is on tmpfs (memory), not a disk: the persist numbers mean little")
        print(f"slots: {self.shm_dir}; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
              f"{os.cpu_count()} CPUs")

        self.raw = RawBuffer(self.state, self.shm_dir)
        for _ in range(2):
            self.raw.copy(self.state)
        warm = [timed(lambda: self.raw.copy(self.state))[0] for _ in range(5)]
        self.step_fn = SimulatedStep(a.step, a.step_ratio * statistics.median(warm))

        self.ck = self.new_checkpointer("main", retention=RetentionPolicy(keep_last=2))
        wait_saver_connected(self.ck)
        for _ in range(3):  # both slots created and written once
            self.save_ok(self.ck.save(self.next_step(), self.state, persist=False))

        if not a.skip_dcp:
            self.setup_dcp()

    def setup_dcp(self) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        store = dist.FileStore(os.path.join(self.root, "pg-filestore"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        self.dist_initialized = True
        # Untimed warm-up: thread mode, then process mode (its first call spawns a daemon process).
        self.dcp_async("dcp-warm-thread", process=False)[1].result()
        # The daemon process logs every request at INFO on its stderr: send that to a file.
        log_path = os.path.join(self.root, "dcp-daemon.log")
        saved_stderr = os.dup(2)
        try:
            with open(log_path, "ab") as log:
                sys.stderr.flush()
                os.dup2(log.fileno(), 2)
                try:
                    self.dcp_async("dcp-warm-process", process=True)[1].result(timeout=300)
                finally:
                    sys.stderr.flush()
                    os.dup2(saved_stderr, 2)
        except Exception as exc:  # reported, the rest of the benchmark goes on
            self.dcp_process_ok = False
            self.samples.errors["dcp_async_save_process"] = f"{type(exc).__name__}: {exc}"
            print(f"dcp async_save with AsyncCheckpointerType.PROCESS does not work here: {exc}")
        finally:
            os.close(saved_stderr)
        drop_path(os.path.join(self.root, "dcp-warm-thread"))
        drop_path(os.path.join(self.root, "dcp-warm-process"))

    def teardown(self) -> None:
        for ck in self.checkpointers:
            try:
                ck.close()
            except Exception as exc:
                print(f"closing the checkpointer of {ck.url} failed: {exc}")
        self.checkpointers.clear()
        if self.raw is not None:
            self.raw.close()
        if self.dist_initialized:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if not self.args.keep and self.root:
            shutil.rmtree(self.root, ignore_errors=True)
            time.sleep(0.5)  # let the savers, told the job is over, exit before their run dirs go
            for run_dir in self.run_dirs:
                shutil.rmtree(run_dir, ignore_errors=True)
        left = [p for p in self.slot_paths if os.path.exists(p)]
        print(f"shared memory left by the checkpointers after close(): {', '.join(left) if left else 'none'} "
              f"({len(self.slot_paths)} slot paths used)")
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)  # ours alone; removes anything left there

    def new_checkpointer(self, name: str, **config: Any) -> Checkpointer:
        path = os.path.join(self.root, f"{name}-{uuid.uuid4().hex[:8]}")
        ck = Checkpointer(path, CheckpointerConfig(job_id=f"bench-{uuid.uuid4().hex}", shm_dir=self.shm_dir, **config))
        self.checkpointers.append(ck)
        self.run_dirs.append(ck.run_dir)
        self.slot_paths.extend(ck.slot_paths)
        return ck

    def close_checkpointer(self, ck: Checkpointer) -> None:
        ck.close()
        self.checkpointers.remove(ck)
        shutil.rmtree(ck.url, ignore_errors=True)  # its saver exits on its own; run dir goes in teardown

    def next_step(self) -> int:
        self.step += 1
        return self.step

    @staticmethod
    def save_ok(result: Any) -> Any:
        if not result.ok:
            raise RuntimeError(f"save of step {result.step} did not happen: {result.status} {result.reason}")
        return result

    def quiesce(self) -> None:
        """Nothing of ours in flight, dirty pages written back: each measurement starts equal."""
        self.ck.wait()
        os.sync()
        time.sleep(self.settle)  # let the file system finish deferred work (discards of deleted files)

    # -- one repeat of every metric --

    def repeat(self, rep: int) -> None:
        self.measure_raw_copy()
        self.measure_warm_save()
        self.measure_overlap()
        self.measure_restore()
        self.measure_first_save(prepare=True)
        self.measure_first_save(prepare=False)
        self.measure_call_to_committed()
        self.measure_torch_save(rep)
        if self.dcp is not None:
            self.measure_dcp(rep, process=False)
            if self.dcp_process_ok:
                self.measure_dcp(rep, process=True)

    def measure_raw_copy(self) -> None:
        self.quiesce()
        self.samples.add("raw_copy", timed(lambda: self.raw.copy(self.state))[0])

    def measure_warm_save(self) -> None:
        self.quiesce()
        seconds, r = timed(lambda: self.ck.save(self.next_step(), self.state, persist=False))
        self.save_ok(r)
        if r.status is not SaveStatus.IN_MEMORY:
            raise RuntimeError(f"warm save returned {r.status}")
        self.samples.add("warm_save", seconds)

    def measure_overlap(self) -> None:
        self.quiesce()
        raw = self.samples.values["raw_copy"][-1]  # measured just before, in this repeat
        alone = timed(self.step_fn)[0]
        if self.step_fn.mode == "matmul" and not 1.5 * raw <= alone <= 4 * raw:
            # The machine got faster or slower since the calibration: re-aim at step_ratio x raw_copy.
            self.step_fn.target_s = self.args.step_ratio * raw
            self.step_fn.rescale(alone)
            self.recalibrations += 1
            alone = timed(self.step_fn)[0]
        self.samples.add("step_alone", alone)
        self.quiesce()
        t0 = time.perf_counter()
        r = self.ck.save(self.next_step(), self.state, persist=False, async_snapshot=True)
        t1 = time.perf_counter()
        self.step_fn()
        t2 = time.perf_counter()
        self.ck.wait_for_snapshot()  # what the optimizer step pre-hook does
        t3 = time.perf_counter()
        self.save_ok(r)
        outcome = r.wait()
        if outcome.error:
            raise RuntimeError(f"overlapped snapshot failed: {outcome.error}")
        self.samples.add("overlap_save_call", t1 - t0)
        self.samples.add("overlap_wait", t3 - t2)
        self.samples.add("overlap_stall", (t1 - t0) + (t3 - t2))
        self.samples.add("step_with_copy", t2 - t1)
        self.samples.add("step_slowdown", (t2 - t1) / alone)

    def measure_restore(self) -> None:
        self.quiesce()
        with torch.no_grad():  # a restarted job: live tensors hold something else
            for t in self.state.values():
                t.zero_()
        seconds, res = timed(lambda: self.ck.load(target=self.state))
        if res is None or res.source != "memory":
            raise RuntimeError(f"restore did not come from memory: {res and res.source}")
        bad = [k for k, v in self.state.items() if not torch.equal(v, self.reference[k])]
        if bad:
            self.restore_correct = False
            self.samples.errors["restore"] = (
                f"ck.load(target=state) from memory restored wrong data into {len(bad)}/{len(self.state)} "
                f"tensors (first: {bad[0]})"
            )
            with torch.no_grad():  # put the right values back for the other measurements
                for k, v in self.state.items():
                    v.copy_(self.reference[k])
        self.samples.add("restore", seconds)

    def measure_first_save(self, prepare: bool) -> None:
        self.quiesce()
        ck = self.new_checkpointer("first" if prepare else "cold")
        try:
            wait_saver_connected(ck)
            os.sync()
            if prepare:
                self.samples.add("prepare", timed(lambda: ck.prepare(self.state))[0])
            seconds, r = timed(lambda: ck.save(self.next_step(), self.state, persist=False))
            self.save_ok(r)
            self.samples.add("first_save" if prepare else "first_save_cold", seconds)
        finally:
            self.close_checkpointer(ck)

    def measure_call_to_committed(self) -> None:
        self.quiesce()
        step = self.next_step()
        started = time.time()
        t0 = time.perf_counter()
        r = self.ck.save(step, self.state, persist=True)
        outcome = r.wait()
        seconds = time.perf_counter() - t0
        self.save_ok(r)
        if not outcome.committed:
            raise RuntimeError(f"step {step} was not committed: {outcome.error}")
        returned = time.time()
        self.samples.add("persist_save_call", r.blocking_s)
        self.samples.add("call_to_committed", seconds)
        # Where the time went, from the files' modification times (kernel clock, ~ms).
        layout = self.ck.layout
        stamps = [started]
        with contextlib.suppress(OSError):
            for rel in (f"{layout.step_path(step)}/{STATE_FILE.format(rank=0)}", layout.rank_marker(step, 0),
                        f"{layout.marker_dir(step)}/COMMITTED"):
                stamps.append(os.stat(os.path.join(self.ck.url, rel)).st_mtime)
            stamps.append(returned)
            for name, a, b in zip(("c2c_write", "c2c_fsync_marker", "c2c_commit", "c2c_seen"), stamps, stamps[1:]):
                self.samples.add(name, max(0.0, b - a))
        # Retention deletes old steps after the commit, in the saver (a 1 GiB unlink is not
        # free): let it finish before the next measurement starts.
        keep = self.ck.config.retention.keep_last or 0
        markers = os.path.join(self.ck.url, Layout.marker_dir(0).rsplit("/", 1)[0])

        def retained() -> bool:
            steps = [d for d in os.listdir(self.ck.url) if d.startswith("step-")]
            return len(steps) <= keep and len(os.listdir(markers)) <= keep

        deadline = time.monotonic() + 30
        while keep and time.monotonic() < deadline and not retained():
            time.sleep(0.02)

    def measure_torch_save(self, rep: int) -> None:
        path = os.path.join(self.root, "torch_save.pt")

        drop_path(path)
        self.quiesce()
        self.samples.add("torch.save", timed(lambda: torch.save(self.state, path))[0])

        drop_path(path)
        self.quiesce()

        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            t1 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        self.samples.add("torch.save+fsync", t2 - t0)
        self.samples.add("torch.save+fsync:write", t1 - t0)
        self.samples.add("torch.save+fsync:fsync", t2 - t1)

        self.quiesce()
        seconds, loaded = timed(lambda: torch.load(path, weights_only=True))
        if len(loaded) != len(self.state):
            raise RuntimeError("torch.load returned a different state")
        del loaded
        self.samples.add("torch.load", seconds)
        drop_path(path)

    def dcp_async(self, name: str, process: bool) -> tuple[float, Any]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        path = os.path.join(self.root, name)
        return timed(lambda: self.dcp.async_save(dict(self.state), checkpoint_id=path, async_checkpointer_type=kind))

    def measure_dcp(self, rep: int, process: bool) -> None:
        key = "dcp_async_save_process" if process else "dcp_async_save_thread"
        name = f"{key}-{rep}"
        drop_path(os.path.join(self.root, f"{key}-{rep - 1}"))
        self.quiesce()
        t0 = time.perf_counter()
        seconds, future = self.dcp_async(name, process)
        try:
            future.result(timeout=300)  # outside the blocking time
        except Exception as exc:
            self.samples.errors[key] = f"{type(exc).__name__}: {exc}"
            if process:
                self.dcp_process_ok = False
            return
        self.samples.add(key, seconds)
        self.samples.add(f"{key}_done", time.perf_counter() - t0)
        drop_path(os.path.join(self.root, name))


# --- report --------------------------------------------------------------------------------


TARGETS = {
    # metric: (base metric, max ratio)
    "warm_save": ("raw_copy", 1.2),
    "overlap_stall": ("raw_copy", 0.2),
    "first_save": ("warm_save", 2.0),
    "restore": ("raw_copy", 1.5),
    "call_to_committed": ("torch.save+fsync", 1.0),
}

ROWS = [
    # (metric, GiB/s meaningful, group)
    ("raw_copy", True, "limit"),
    ("warm_save", True, "flashckpt"),
    ("overlap_stall", False, "flashckpt"),
    ("step slowdown", False, "flashckpt"),
    ("prepare", True, "flashckpt"),
    ("first_save", True, "flashckpt"),
    ("first_save_cold", True, "flashckpt"),
    ("restore", True, "flashckpt"),
    ("call_to_committed", True, "flashckpt"),
    ("torch.save", True, "baseline"),
    ("torch.save+fsync", True, "baseline"),
    ("torch.load", True, "baseline"),
    ("dcp_async_save_thread", True, "baseline"),
    ("dcp_async_save_thread_done", True, "baseline"),
    ("dcp_async_save_process", True, "baseline"),
    ("dcp_async_save_process_done", True, "baseline"),
]

DETAILS = [
    ("overlap_save_call", "save(async_snapshot=True) call"),
    ("overlap_wait", "wait_for_snapshot() after the step"),
    ("step_alone", "simulated step, alone"),
    ("step_with_copy", "simulated step, with the snapshot copy running"),
    ("persist_save_call", "save(persist=True) blocking part of call_to_committed"),
    ("c2c_write", "c2c: save() called -> data file written (copy, saver write, crc)"),
    ("c2c_fsync_marker", "c2c: data file written -> rank marker (fsync, rename, marker)"),
    ("c2c_commit", "c2c: rank marker -> COMMITTED (committer)"),
    ("c2c_seen", "c2c: COMMITTED -> r.wait() returned"),
    ("torch.save+fsync:write", "torch.save+fsync: torch.save into the file"),
    ("torch.save+fsync:fsync", "torch.save+fsync: flush + fsync"),
]


def build_report(bench: Bench) -> dict[str, Any]:
    s = bench.samples
    med = {name: s.median(name) for name in s.values}
    raw = med.get("raw_copy")
    gib = bench.nbytes / GIB
    rows = []
    for metric, rate, group in ROWS:
        if metric == "step slowdown":
            with_copy, slowdown = med.get("step_with_copy"), med.get("step_slowdown")
            if with_copy and slowdown:
                rows.append({"metric": metric, "group": group, "median_s": with_copy,
                             "min_s": s.min("step_with_copy"), "gib_s": None,
                             "x_raw_copy": with_copy / raw if raw else None, "ratio": slowdown,
                             "target": "info (step with copy)",
                             "result": f"{slowdown:.2f}x the step alone"})
            continue
        value = med.get(metric)
        if value is None:
            if metric in s.errors:
                rows.append({"metric": metric, "group": group, "median_s": None, "min_s": None, "gib_s": None,
                             "x_raw_copy": None, "ratio": None, "target": "-", "result": "ERROR"})
            continue
        row = {"metric": metric, "group": group, "median_s": value, "min_s": s.min(metric),
               "gib_s": gib / value if rate and value > 0 else None,
               "x_raw_copy": value / raw if raw else None, "ratio": None, "target": "-", "result": ""}
        if metric in TARGETS:
            base_name, limit = TARGETS[metric]
            base = med.get(base_name)
            row["target"] = f"<= {limit:g}x {base_name}"
            if base:
                row["ratio"] = value / base
                ok = row["ratio"] <= limit
                if metric == "restore" and not bench.restore_correct:
                    row["result"] = "FAIL (wrong data)"
                else:
                    row["result"] = "PASS" if ok else "FAIL"
                row["result"] += f" ({row['ratio']:.2f}x)"
        elif group == "baseline":
            row["target"] = "baseline"
        rows.append(row)
    return {
        "config": {k: v for k, v in vars(bench.args).items()},
        "state_bytes": bench.nbytes,
        "tensors": len(bench.state),
        "step_mode": bench.step_fn.mode,
        "step_matmul_iters": bench.step_fn.iters,
        "step_target_s": bench.step_fn.target_s,
        "step_recalibrations": bench.recalibrations,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "medians": med,
        "mins": {name: s.min(name) for name in s.values},
        "samples": s.values,
        "errors": s.errors,
        "rows": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    def fmt(v: float | None, spec: str) -> str:
        width = int(spec.split(".")[0] or 0)
        return f"{'-':>{width}}" if v is None else format(v, spec)

    header = f"{'metric':<28} {'median s':>9} {'min s':>7} {'GiB/s':>6} {'x raw_copy':>10}  {'target':<26} result"
    print()
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        print(f"{row['metric']:<28} {fmt(row['median_s'], '9.3f')} {fmt(row['min_s'], '7.3f')} "
              f"{fmt(row['gib_s'], '6.2f')} {fmt(row['x_raw_copy'], '10.2f')}  {row['target']:<26} {row['result']}")
    med = report["medians"]
    print()
    print("details (medians):")
    for name, label in DETAILS:
        if med.get(name) is not None:
            print(f"  {label:<66} {med[name]:.3f} s")
    if report["step_mode"] == "matmul":
        what = f"{report['step_matmul_iters']} matmuls of 384x384 float32 (real compute, 2 intra-op threads)"
    else:
        what = f"time.sleep({report['step_target_s']:.3f})"
    if med.get("step_alone") and med.get("raw_copy"):
        what += f"; alone it takes {med['step_alone'] / med['raw_copy']:.2f}x raw_copy"
    if report["step_recalibrations"]:
        what += f" (re-calibrated {report['step_recalibrations']}x during the run)"
    print(f"  simulated step: {what}")
    comparisons = [
        ("warm_save", "dcp_async_save_thread", "warm_save vs dcp.async_save(thread) blocking"),
        ("warm_save", "dcp_async_save_process", "warm_save vs dcp.async_save(process) blocking"),
        ("warm_save", "torch.save", "warm_save vs torch.save"),
        ("overlap_stall", "dcp_async_save_thread", "overlap_stall vs dcp.async_save(thread) blocking"),
        ("call_to_committed", "torch.save+fsync", "call_to_committed vs torch.save+fsync"),
        ("call_to_committed", "dcp_async_save_thread_done", "call_to_committed vs dcp.async_save(thread) done"),
        ("restore", "torch.load", "restore vs torch.load"),
    ]
    print()
    print("flashckpt vs baselines (ratio of medians, < 1 is faster):")
    for a, b, label in comparisons:
        if med.get(a) and med.get(b):
            print(f"  {label:<66} {med[a] / med[b]:.3f}")
    if report["errors"]:
        print()
        print("errors:")
        for name, err in report["errors"].items():
            print(f"  {name}: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    parser.add_argument("--tensors", type=int, default=400, help="number of float32 tensors (default 400)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per metric; medians are reported")
    parser.add_argument("--dir", default=None,
                        help="local-disk directory to work in (a fresh temp dir is made inside it; default /tmp)")
    parser.add_argument("--shm-base", default="/dev/shm",
                        help="tmpfs directory in which a private slot directory is made (default /dev/shm)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--step", choices=("matmul", "sleep"), default="matmul",
                        help="simulated training step of the overlap test: real compute or time.sleep")
    parser.add_argument("--step-ratio", type=float, default=2.5,
                        help="length of the simulated step as a multiple of raw_copy (default 2.5)")
    parser.add_argument("--skip-dcp", action="store_true", help="skip the torch.distributed.checkpoint baselines")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds to wait after sync before each disk measurement (default 1.0)")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.tensors < 1 or args.repeats < 1:
        parser.error("--gib, --tensors and --repeats must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.perf_counter()
    bench = Bench(args)
    try:
        bench.setup()
        print(f"setup done in {time.perf_counter() - started:.1f}s; {args.repeats} repeats", flush=True)
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            bench.repeat(rep)
            print(f"  repeat {rep + 1}/{args.repeats}: {time.perf_counter() - t0:.1f}s", flush=True)
        report = build_report(bench)
    finally:
        bench.teardown()
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    print(f"\ntotal run time {report['wall_s']:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
