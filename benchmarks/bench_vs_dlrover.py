#!/usr/bin/env python3
"""flashckpt against DLRover 0.6.1's Flash Checkpoint, on one state, in one run.

Every measurement runs in a worker process of the right virtualenv: ours in this interpreter's
(``sys.executable``), DLRover's in ``.venv-dlrover`` (build it with ``scripts/dlrover-venv.sh``).
Each repeat runs the raw limits, ours and DLRover's in turn, the order of ours and DLRover's
alternated from one repeat to the next; each ratio is taken within a repeat; the table gives the
median over the repeats and, in parentheses, the smallest and largest repeat. Both sides run with
one torch thread, no process group (one rank) and the same state: ``--mib`` MiB of float32 in
``--tensors`` tensors (default 1.02 GiB in 433), built before the checkpointer, as a model is;
each worker imports its library and runs one full garbage collection before it times anything
(see ``build``), and reports the collections that still ran inside each timed call.

What is timed, for both:
  warm save        ``save`` into memory once the buffers exist (median of 3 in each repeat)
  first save       the first memory save in a fresh process, right after construction, no prepare()
  construction     from the constructor's call until the saver process answers a request
  first write      the first in-place write of the live state after construction (a training
                   step's update): shows what a saver forked from the trainer costs it
  restore          from memory into the live tensors (``target=``), after the state was overwritten
  restore (crash)  in a new process, after the one that saved was killed with SIGKILL
  call-to-committed  a persisting save on local disk, until the commit is visible on disk
                   (both polled every 2 ms: our COMMITTED marker, DLRover's tracker file)
  shared memory    /dev/shm bytes held (allocated blocks of the job's files) against the state
and the DISK-then-MEMORY race: a persisting save of step N and at once a memory save of N+1.
Ours alone: the slowest of a job's first three persisting saves taken before its saver is up
(its start held back; see ``task_early``), against our warm save in the same process.

DLRover specifics (read in the 0.6.1 wheel; they decide how it is driven here):
  * API: ``dlrover.trainer.torch.flash_checkpoint.ddp.DdpCheckpointer(dir)``,
    ``save_checkpoint(step, state_dict, path, storage_type=StorageType.MEMORY|DISK)``,
    ``load_checkpoint()``. Without dlrover-run it reads LOCAL_RANK, NODE_RANK, GROUP_RANK and
    TORCHELASTIC_RUN_ID from the environment (set here; the run id scopes its socket directory
    /tmp/ckpt_sock/<id>/ and its buffer /dev/shm/<id>_ckpt_shm_0, which are fixed names otherwise).
  * Its saver: without dlrover-run the constructor forks it from the trainer
    (``multiprocessing.Process(daemon=True)``, the fork start method of Python 3.11) on local
    rank 0; the trainer's memory is then shared copy-on-write with it, and the trainer's next
    write of each page faults (the "first write" row). Construction is timed until
    ``DdpCheckpointer(...)`` returns (it polls every 0.1 s until the saver's event queue and
    shared-memory lock sockets exist) plus one round trip to the saver's lock server
    (``_engine._shm_lock.locked()``), the counterpart of our ping.
  * Its startup race: the saver's SharedQueue and SharedLock bind their socket before the queue
    or lock behind it exists; a request that comes in between is answered ERROR, which the
    client ignores, so the saver is never created and the constructor raises TimeoutError after
    60 s. Such a start is counted ("hung starts"), its worker ended after ``START_TIMEOUT_S`` and
    run again.
  * Memory: one buffer per node, created with ftruncate (sparse) and mapped without
    MAP_POPULATE, so the first save faults every page in; the tensor metadata is pickled to the
    saver over a Unix socket at each save. A save while the saver holds the buffer's lock is
    skipped, and ``save_checkpoint`` returns nothing; one that takes the lock before the saver
    overwrites the step the saver was told to persist, which the saver then drops ("The step N
    in event is no equal to step N+1 in memory"): the two outcomes of the race.
  * Load: ``load_checkpoint()`` returns ``torch.frombuffer`` views of the shared memory (no copy);
    restoring into the live tensors is the ``copy_`` that ``load_state_dict`` does, timed with it.
  * After a crash, memory is found only when the saver outlives the trainer: dlrover-run's agent
    hosts it. That is emulated as the agent does it (``AsyncCheckpointSaver
    .start_async_saving_ckpt()`` in the parent, trainers with ROLE_NAME=dlrover-trainer,
    ``AsyncCheckpointSaver.reset()`` before the restart). Without the agent (checked once) the
    killed trainer's forked saver lives on as an orphan and the restarted trainer forks another,
    empty one; both serve the same socket paths (the new one unlinks and rebinds each as it gets
    to it), so whether the restart finds the snapshot depends on which answers first.
  * Persist: the saver thread ``torch.save``s the views to <dir>/<step>/rank_0.pt with no fsync;
    its done file and the tracker dlrover_latest.txt are fsynced. The fsync of the data file that
    it skips is timed after its commit ("durable" detail). Ours fsyncs the data before committing.
  * The buffer is not unlinked when the trainer exits (the forked saver is terminated without
    its close()): the run removes it and reports what was left.

Run ``python benchmarks/bench_vs_dlrover.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

MIB = 1 << 20
GIB = 1 << 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DLROVER_VENV = os.environ.get("FLASHCKPT_DLROVER_VENV", os.path.join(REPO, ".venv-dlrover"))
SYSTEMS = ("raw", "dlrover", "ours")
POLL_S = 0.002
WARM_SAVES = 3
CONSTRUCT_ATTEMPTS = 4
EARLY_HOLD_S = 15.0
"""How long ``task_early`` holds the saver's start back: longer than prepare() and three saves take."""
EARLY_GAP_S = 0.5
"""Seconds between those saves (the training steps between them)."""
START_TIMEOUT_S = 30.0
"""A constructor that has not returned by then hung in DLRover's startup race (normally < 1 s)."""
HUNG = "Timed out waiting for socket server"
DLROVER_ENV = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "WORLD_SIZE": "1", "NODE_RANK": "0",
               "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}


# --- the state -----------------------------------------------------------------------------


def make_state(mib: float, count: int, seed: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in ``count`` tensors of log-uniformly varied sizes (the sizes do not
    depend on ``seed``, the values do); filled from a 16 MiB random pool, every page written."""
    sizes = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.empty(count, dtype=torch.float64).uniform_(0.0, math.log(2000.0), generator=sizes))
    total = int(mib * MIB) // 4
    pool = torch.randn(4 * MIB, generator=torch.Generator().manual_seed(1000 + seed))
    state: dict[str, torch.Tensor] = {}
    for i, w in enumerate((weights / weights.sum()).tolist()):
        numel = max(1, int(w * total))
        shape: tuple[int, ...] = (numel // 1024, 1024) if numel >= 4096 else (numel,)
        t = torch.empty(shape)
        flat, pos, off = t.view(-1), 0, (i * 104729) % pool.numel()
        while pos < flat.numel():
            n = min(flat.numel() - pos, pool.numel() - off)
            flat[pos : pos + n].copy_(pool[off : off + n])
            pos, off = pos + n, 0
        state[f"layer{i:03d}.weight"] = t.add_(i)
    return state


def fingerprint(state: dict[str, torch.Tensor]) -> list[float]:
    """Per-tensor sums (same data, same torch, one thread: the same floats)."""
    return [float(t.sum()) for t in state.values()]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def overwrite(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in state.values():
            t.zero_()


def copy_into(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """What ``load_state_dict`` does with a state dict: copy each tensor into the live one."""
    with torch.no_grad():
        for name, t in target.items():
            t.copy_(source[name])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class GcClock:
    """Seconds the cyclic garbage collector has run in this process (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._started


GC_CLOCK = GcClock()


def measure(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Time ``fn`` into ``out[name]``, and the garbage collections inside it into ``out[name + "_gc"]``."""
    before = GC_CLOCK.total
    out[name], result = timed(fn)
    out[name + "_gc"] = GC_CLOCK.total - before
    return result


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(POLL_S)


def quiesce(settle: float) -> None:
    os.sync()
    time.sleep(settle)


def held_bytes(paths: list[str]) -> int:
    """Bytes of memory the files hold (allocated blocks; a sparse file holds what was written)."""
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(path).st_blocks * 512
    return total


def file_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def marker_of(path: str) -> float | None:
    """Element 0 of the first tensor in a saved file (the race writes the step there)."""
    if not os.path.exists(path):
        return None
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    loaded = loaded.get("model_states", loaded)
    return float(next(iter(loaded.values())).view(-1)[0])


# --- the three systems, driven the same way ------------------------------------------------


class Raw:
    """The limits: plain copies into /dev/shm mappings, torch.save + fsync."""

    name = "raw"

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.path = os.path.join(p["shm_dir"], f"raw-{p['job']}")
        self.mm: mmap.mmap | None = None
        self.buffer: torch.Tensor | None = None

    def construct(self) -> float | None:
        return None

    def map(self, size: int, create: bool) -> torch.Tensor:
        """Map the buffer's file, made anew (sparse: the first copy faults its pages in) or as it is."""
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.buffer

    def views(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        offset = 0
        for t in state.values():
            nbytes = t.numel() * t.element_size()
            yield self.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape), t
            offset += (nbytes + 63) // 64 * 64

    def save_memory(self, step: int, state: dict[str, torch.Tensor]) -> None:
        if self.buffer is None:  # the first: a fresh, sparse mapping, every page faulted by the copy
            self.map(sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in state.values()), True)
        with torch.no_grad():
            for view, t in self.views(state):
                view.copy_(t)

    def restore(self, state: dict[str, torch.Tensor]) -> str:
        if self.buffer is None:  # a new process: a fresh mapping of the file the killed one wrote
            self.map(os.path.getsize(self.path), False)
        with torch.no_grad():
            for view, t in self.views(state):
                t.copy_(view)
        return "memory"

    def save_persist(self, step: int, state: dict[str, torch.Tensor]) -> tuple[float, float]:
        path = os.path.join(self.p["dir"], f"raw-{step}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        os.unlink(path)
        return seconds, seconds

    def shm_paths(self) -> list[str]:
        return [self.path]

    def close(self) -> None:
        self.buffer = None
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Ours:
    name = "ours"

    def __init__(self, p: dict[str, Any], **config: Any) -> None:
        self.p = p
        self.config = config
        self.ck: Any = None

    def construct(self) -> float:
        from flashckpt_integrations import Checkpointer

        def start() -> Any:
            ck = Checkpointer(self.p["ckpt"], job_id=self.p["job"], shm_dir=self.p["shm_dir"], **self.config)
            ck.client.connect()
            answer = ck.client.request({"op": "ping"}).result(30)
            if not answer.get("ok", True):
                raise RuntimeError(f"the saver answered {answer}")
            return ck

        seconds, self.ck = timed(start)
        return seconds

    def save_memory(self, step: int, state: dict[str, torch.Tensor]) -> None:
        r = self.ck.save(step, state, persist=False)
        if not r.ok:
            raise RuntimeError(f"memory save of step {step}: {r.status} {r.reason}")

    def restore(self, state: dict[str, torch.Tensor]) -> str:
        res = self.ck.load(target=state)
        return res.source if res is not None else "none"

    def committed(self, step: int) -> bool:
        from flashckpt_integrations import Layout

        return os.path.exists(os.path.join(self.ck.url, Layout.marker_dir(step), "COMMITTED"))

    def save_persist(self, step: int, state: dict[str, torch.Tensor]) -> tuple[float, float]:
        t0 = time.perf_counter()
        r = self.ck.save(step, state, persist=True)
        blocking = time.perf_counter() - t0
        wait_until(lambda: self.committed(step), 600, f"commit of step {step}")
        seconds = time.perf_counter() - t0
        outcome = r.wait()
        if not outcome.committed:
            raise RuntimeError(f"step {step} was not committed: {outcome.error}")
        return seconds, blocking

    def data_file(self, step: int) -> str:
        from flashckpt_integrations.core.engine import STATE_FILE

        return os.path.join(self.ck.url, self.ck.layout.step_path(step), STATE_FILE.format(rank=0))

    def race(self, step: int, state: dict[str, torch.Tensor]) -> tuple[bool, bool]:
        first = next(iter(state.values())).view(-1)
        first[0] = step
        r = self.ck.save(step, state, persist=True)
        first[0] = step + 1
        r2 = self.ck.save(step + 1, state, persist=False)
        outcome = r.wait()
        on_disk = bool(outcome.committed) and marker_of(self.data_file(step)) == step
        res = self.ck.load(step + 1) if r2.ok and step + 1 in self.ck.memory_steps() else None
        in_memory = (res is not None and res.source == "memory"
                     and float(res.state[next(iter(state))].view(-1)[0]) == step + 1)
        return on_disk, in_memory

    def shm_paths(self) -> list[str]:
        return list(self.ck.slot_paths)

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


class DLRover:
    name = "dlrover"

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.ck: Any = None

    def construct(self) -> float:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        def start() -> Any:
            ck = DdpCheckpointer(self.p["ckpt"])
            answer = ck._engine._shm_lock.locked()  # a round trip to the saver's lock server
            if getattr(answer, "status", "OK") != "OK":
                raise RuntimeError(f"the saver answered {answer}")
            return ck

        seconds, self.ck = timed(start)
        return seconds

    def path(self, step: int) -> str:
        return os.path.join(self.p["ckpt"], str(step), "rank_0.pt")

    def save_memory(self, step: int, state: dict[str, torch.Tensor]) -> None:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        self.ck.save_checkpoint(step, state, self.path(step), storage_type=StorageType.MEMORY)
        if self.ck._engine._cached_step != step:  # save_checkpoint returns nothing; a skip leaves it
            raise RuntimeError(f"DLRover skipped the memory save of step {step}")

    def restore(self, state: dict[str, torch.Tensor]) -> str:
        loaded = self.ck.load_checkpoint()
        if not loaded:
            return "none"
        copy_into(state, loaded)
        return "memory"

    def committed(self, step: int) -> bool:
        return file_text(os.path.join(self.p["ckpt"], "dlrover_latest.txt")) == str(step)

    def save_persist(self, step: int, state: dict[str, torch.Tensor]) -> tuple[float, float]:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        t0 = time.perf_counter()
        self.ck.save_checkpoint(step, state, self.path(step), storage_type=StorageType.DISK)
        blocking = time.perf_counter() - t0
        wait_until(lambda: self.committed(step), 600, f"DLRover's commit of step {step}")
        return time.perf_counter() - t0, blocking

    def fsync_data(self, step: int) -> float:
        """The fsync its saver skips: what making step ``step``'s file durable costs after the commit."""
        t0 = time.perf_counter()
        fd = os.open(self.path(step), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def wait_saver_idle(self, timeout: float = 120) -> None:
        """Queue a no-op event behind the saver's work; the queue is empty once it took it."""
        from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointEvent, CheckpointEventType

        queue = self.ck._engine._event_queue
        queue.put(CheckpointEvent(type=CheckpointEventType.UPDATE_SHARD, global_shard_num=1))
        wait_until(queue.empty, timeout, "DLRover's saver going idle")

    def race(self, step: int, state: dict[str, torch.Tensor]) -> tuple[bool, bool]:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        first = next(iter(state.values())).view(-1)
        first[0] = step
        self.ck.save_checkpoint(step, state, self.path(step), storage_type=StorageType.DISK)
        first[0] = step + 1
        self.ck.save_checkpoint(step + 1, state, self.path(step + 1), storage_type=StorageType.MEMORY)
        self.wait_saver_idle()
        on_disk = self.committed(step) and marker_of(self.path(step)) == step
        loaded = self.ck.load_checkpoint()
        in_memory = bool(loaded) and float(next(iter(loaded.values())).view(-1)[0]) == step + 1
        return on_disk, in_memory

    def shm_paths(self) -> list[str]:
        return [os.path.join("/dev/shm", self.ck._engine._shm_handler._shm_name.lstrip("/"))]

    def close(self) -> None:
        if self.ck is not None:
            self.ck._engine.close()


def system_for(p: dict[str, Any], **config: Any) -> Raw | Ours | DLRover:
    return {"raw": Raw, "ours": Ours, "dlrover": DLRover}[p["system"]](p, **config)


# --- worker tasks (run in the system's virtualenv) -----------------------------------------


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build(p: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The process's model state, with its checkpointing library imported and one full garbage
    collection run, as in a training script long past its imports: a fresh interpreter's first
    full collection (0.3-0.6 s here, over torch's objects) would otherwise fall into whichever
    timed call allocates next, and a lazily importing library's calls are the ones it hits."""
    state = make_state(p["mib"], p["tensors"], seed=seed)
    if p["system"] == "ours":
        from flashckpt_integrations import Checkpointer  # noqa: F401
    elif p["system"] == "dlrover":
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer  # noqa: F401
    gc.collect()
    say("BUILT")
    return state


def start(system: Raw | Ours | DLRover) -> float | None:
    """Construct, and tell the parent (which watches for DLRover's startup race)."""
    seconds = system.construct()
    say("CONSTRUCTED")
    return seconds


def task_session(p: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: construction, first save, warm saves, first write, restore, persist, shm."""
    out: dict[str, Any] = {}
    state = build(p, seed=0)
    expected = fingerprint(state)
    out["state_bytes"] = state_bytes(state)
    system = system_for(p)
    try:
        collected = GC_CLOCK.total
        out["construct"] = start(system)
        out["construct_gc"] = GC_CLOCK.total - collected
        measure(out, "first_save", lambda: system.save_memory(1, state))
        for step in (2, 3):  # untimed: every buffer exists and was written once
            system.save_memory(step, state)
        out["warm_save"] = statistics.median(timed(lambda s=s: system.save_memory(s, state))[0]
                                             for s in range(4, 4 + WARM_SAVES))
        out["first_write"] = timed(lambda: overwrite(state))[0]
        source = measure(out, "restore", lambda: system.restore(state))
        if source != "memory" or fingerprint(state) != expected:
            raise RuntimeError(f"{system.name}: restore in the same process came from {source} or restored wrong data")
        quiesce(p["settle"])
        step = 4 + WARM_SAVES
        out["commit"], out["commit_blocking"] = system.save_persist(step, state)
        if isinstance(system, DLRover):
            out["commit_fsync"] = system.fsync_data(step)
        out["shm_paths"] = system.shm_paths()
        out["shm_bytes"] = held_bytes(out["shm_paths"])
    finally:
        system.close()
    if isinstance(system, Ours):
        out["shm_bytes_slots1"] = ours_slots1(p, state)
    return out


def ours_slots1(p: dict[str, Any], state: dict[str, torch.Tensor]) -> int:
    one = Ours({**p, "job": p["job"] + "-s1", "ckpt": p["ckpt"] + "-s1"}, slots=1)
    one.construct()
    try:
        for step in (1, 2):
            one.save_memory(step, state)
        return held_bytes(one.shm_paths())
    finally:
        one.close()


def task_crash_saver(p: dict[str, Any]) -> dict[str, Any]:
    """The process that saves to memory and is then killed (SIGKILL) by its parent."""
    state = build(p, seed=0)
    system = system_for(p)
    start(system)
    for step in (1, 2):
        system.save_memory(step, state)
    engine = getattr(getattr(system, "ck", None), "_engine", None)  # DLRover's: the saver it forked, if any
    saver = getattr(getattr(engine, "saver_proc", None), "pid", None)
    say("READY " + json.dumps({"fingerprint": fingerprint(state), "saver_pid": saver}))
    while True:
        time.sleep(60)


def task_crash_restorer(p: dict[str, Any]) -> dict[str, Any]:
    """The restarted process: it builds its model (other values), then restores from memory."""
    state = build(p, seed=1)
    system = system_for(p)
    out: dict[str, Any] = {}
    try:
        start(system)
        out["source"] = measure(out, "restore_crash", lambda: system.restore(state))
        out["correct"] = fingerprint(state) == p["expected"]
    finally:
        system.close()
    return out


def task_crash(p: dict[str, Any]) -> dict[str, Any]:
    """Parent of a crash: start the saving process, kill it, start the restoring one. For DLRover
    with ``agent`` this process hosts the saver, as dlrover-run's agent does."""
    env, agent = dict(os.environ), p["system"] == "dlrover" and p.get("agent")
    if agent:
        from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

        AsyncCheckpointSaver.start_async_saving_ckpt()
        env["ROLE_NAME"] = "dlrover-trainer"
    timeout = 300 + p["mib"] / 10
    a = Worker(sys.executable, "crash_saver", p, env=env).start()
    try:
        a.started(timeout)
        ready = json.loads(a.wait_line("READY", timeout))
        a.crash()
        if agent:
            AsyncCheckpointSaver.reset()  # what the agent does before it restarts the workers
        b = Worker(sys.executable, "crash_restorer", {**p, "expected": ready["fingerprint"]}, env=env).start()
        out = b.result(timeout)
        if not out.pop("ok", False):
            raise RuntimeError(f"the restarted process failed: {out.get('error')}")
        out["orphan_saver"] = bool(ready["saver_pid"]) and pid_alive(ready["saver_pid"])
        return out
    finally:
        a.end()  # and the killed process's forked saver, if it outlived it
        if agent and AsyncCheckpointSaver.get_ckpt_saver() is not None:
            AsyncCheckpointSaver.get_ckpt_saver().close()


def task_race(p: dict[str, Any]) -> dict[str, Any]:
    state = build(p, seed=0)
    system = system_for(p)
    trials = []
    try:
        start(system)
        system.save_memory(1, state)
        for trial in range(p["trials"]):
            trials.append(system.race(10 * (trial + 1), state))
    finally:
        system.close()
    return {"race": trials}


def task_early(p: dict[str, Any]) -> dict[str, Any]:
    """Ours only: a job's first three persisting saves while its saver's start is held back (this
    process holds the node's spawn lock for ``EARLY_HOLD_S``: a saver still importing on a loaded
    host), ``EARLY_GAP_S`` apart as training steps would be, after ``prepare()``; then the median
    of warm memory saves once the saver is up, in the same process. All three must be committed
    and load bit-equal."""
    import fcntl
    import threading

    from flashckpt_integrations import Checkpointer
    from flashckpt_integrations.core.client import job_key, run_dir_for
    from flashckpt_integrations.core.protocol import SPAWN_LOCK_NAME

    state = build(p, seed=0)
    expected = fingerprint(state)
    node = "early"
    lock = os.open(os.path.join(run_dir_for(job_key(p["job"]), job_key(node)[:8]), SPAWN_LOCK_NAME),
                   os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    release = threading.Timer(EARLY_HOLD_S, lambda: (fcntl.flock(lock, fcntl.LOCK_UN), os.close(lock)))
    release.start()
    out: dict[str, Any] = {}
    ck = Checkpointer(p["ckpt"], job_id=p["job"], shm_dir=p["shm_dir"], node_id=node)
    say("CONSTRUCTED")
    try:
        ck.prepare(state)
        results = []
        for step in (1, 2, 3):
            results.append(ck.save(step, state, persist=True))
            time.sleep(EARLY_GAP_S)
        if ck.client.connected:
            raise RuntimeError("the saver answered before the third save: raise EARLY_HOLD_S")
        out["early_saves"] = [r.blocking_s for r in results]
        for r in results:
            outcome = r.wait(600)
            if not outcome.committed:
                raise RuntimeError(f"step {r.step} was not committed: {outcome.error}")
        out["warm_save_early"] = statistics.median(
            timed(lambda s=s: ck.save(s, state, persist=False))[0] for s in range(4, 4 + WARM_SAVES))
        overwrite(state)
        ck.load(3, target=state, prefer_memory=False)
        if fingerprint(state) != expected:
            raise RuntimeError("step 3 loaded from storage differs from what was saved")
    finally:
        ck.close()
        release.join()
    return out


TASKS = {"session": task_session, "early": task_early, "crash": task_crash, "crash_saver": task_crash_saver,
         "crash_restorer": task_crash_restorer, "race": task_race}


def worker_main(task: str, params_path: str) -> int:
    with open(params_path) as f:
        p = json.load(f)
    torch.set_num_threads(1)
    GC_CLOCK.install()
    try:
        out = TASKS[task](p)
        out["ok"] = True
    except Exception as exc:  # reported to the parent, which decides
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(p["out"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(p["out"] + ".tmp", p["out"])
    return 0


# --- running workers -----------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"
    return False


class Worker:
    """This script run as ``--worker TASK`` by ``python``, as the leader of a process group of its
    own. The worker is reaped only by :meth:`end`, after its group: its id stays its group's."""

    def __init__(self, python: str, task: str, params: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.python, self.task = python, task
        self.params = dict(params)
        self.params["out"] = os.path.join(self.params["work"], f"{task}-{uuid.uuid4().hex[:8]}.json")
        self.env = dict(env or os.environ)
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    def start(self) -> Worker:
        params_path = self.params["out"] + ".params"
        with open(params_path, "w") as f:
            json.dump(self.params, f)
        with open(os.path.join(self.params["work"], "workers.log"), "ab") as log:
            self.proc = subprocess.Popen([self.python, os.path.abspath(__file__), "--worker", self.task, params_path],
                                         stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        return self

    def exited(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the worker to exit, without reaping it."""
        deadline = time.monotonic() + timeout
        while os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The rest of the first line of the worker's stdout that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.startswith(prefix.encode()):
                    return line[len(prefix):].decode().strip()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.task} said no {prefix} within {timeout:.0f}s")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:  # it exited without saying it
                    self.exited(5)
                    raise RuntimeError(f"{self.task} said no {prefix}: {self.error()} (see workers.log)")
                self._buffer += chunk

    def started(self, timeout: float) -> None:
        """Wait until the worker has built its state and constructed its checkpointer."""
        self.wait_line("BUILT", timeout)
        try:
            self.wait_line("CONSTRUCTED", START_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"{HUNG}: the constructor did not return within {START_TIMEOUT_S:.0f}s") from None

    def result(self, timeout: float, watch: bool = True) -> dict[str, Any]:
        """The worker's result, once it exited; with ``watch`` a constructor that hangs ends it early."""
        try:
            if watch:
                self.started(timeout)
            if not self.exited(timeout):
                raise TimeoutError(f"{self.task} took more than {timeout:.0f}s")
        except (RuntimeError, TimeoutError) as exc:
            return {"ok": False, "error": str(exc)}
        finally:
            self.end()
        try:
            with open(self.params["out"]) as f:
                return json.load(f)
        except OSError:
            return {"ok": False, "error": f"{self.task} exited with {self.proc.returncode} and no result"}

    def error(self) -> str:
        with contextlib.suppress(OSError, ValueError), open(self.params["out"]) as f:
            return json.load(f).get("error") or "no error"
        return f"{self.task} left no result"

    def crash(self) -> None:
        """SIGKILL the worker alone (its children, a forked saver, live on) and wait for it to be gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.exited(30)

    def end(self) -> None:
        """SIGKILL what is left of the worker's process group (a forked saver; ours starts a session
        of its own), then reap the worker."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


# --- the orchestrator ----------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.systems = ["raw", "ours"] + ([] if args.only == "ours" else ["dlrover"])
        base = args.dir or "/tmp"
        os.makedirs(base, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="bench-vs-dlrover-", dir=base)
        self.shm_dir = tempfile.mkdtemp(prefix="bench-vs-dlrover-", dir="/dev/shm")
        self.samples: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
        self.ratios: dict[str, list[float]] = {}
        self.notes: dict[str, Any] = {"hung_starts": 0, "dlrover_starts": 0, "left_shm": {}, "errors": []}
        self.state_bytes = 0

    def python(self, system: str) -> str:
        return os.path.join(DLROVER_VENV, "bin", "python") if system == "dlrover" else sys.executable

    def params(self, system: str, **extra: Any) -> dict[str, Any]:
        job = f"bvd{uuid.uuid4().hex[:10]}"
        a = self.args
        return {"system": system, "mib": a.mib, "tensors": a.tensors, "settle": a.settle, "trials": a.trials,
                "job": job, "work": self.work, "dir": self.work, "ckpt": os.path.join(self.work, f"ckpt-{job}"),
                "shm_dir": self.shm_dir, **extra}

    def env(self, p: dict[str, Any]) -> dict[str, str]:
        env = dict(os.environ, **DLROVER_ENV)
        env.pop("ROLE_NAME", None)
        env["TORCHELASTIC_RUN_ID"] = p["job"]
        return env

    def run_worker(self, system: str, task: str, timeout: float, **extra: Any) -> dict[str, Any]:
        """Run a worker; a DLRover start that hung in its startup race is counted and run again."""
        for _ in range(CONSTRUCT_ATTEMPTS):
            p = self.params(system, **extra)
            t0 = time.perf_counter()
            out = Worker(self.python(system), task, p, env=self.env(p)).start().result(timeout, task != "crash")
            print(f"    {system} {task}: {time.perf_counter() - t0:.1f}s", flush=True)
            left = self.clean_dlrover(p)
            if left and task == "session":
                self.notes["left_shm"].setdefault(system, []).append(left)
            if system == "dlrover":
                self.notes["dlrover_starts"] += 1
            error = out.get("error", "")
            if out.get("ok") or HUNG not in error or "restarted process" in error:
                break  # a restarted trainer that hangs is a result of the crash test, not its start
            self.notes["hung_starts"] += 1
            print(f"    DLRover's saver never came up ({error}); running the worker again", flush=True)
        if not out.get("ok"):
            raise RuntimeError(f"{system} {task} failed: {out.get('error')}")
        return out

    def clean_dlrover(self, p: dict[str, Any]) -> int:
        """Remove what a DLRover run leaves (its buffer in /dev/shm, its socket directory) and the
        checkpoint directories; returns the bytes of the buffer that was left."""
        shm = f"/dev/shm/{p['job']}_ckpt_shm_0"
        left = held_bytes([shm])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm)
        shutil.rmtree(os.path.join("/tmp/ckpt_sock", p["job"]), ignore_errors=True)
        shutil.rmtree(p["ckpt"], ignore_errors=True)
        shutil.rmtree(p["ckpt"] + "-s1", ignore_errors=True)
        return left

    def add(self, system: str, metric: str, value: float | None) -> None:
        if value is not None:
            self.samples[system].setdefault(metric, []).append(value)

    def repeat(self, rep: int) -> None:
        order = ["raw"] + [s for s in (("ours", "dlrover") if rep % 2 == 0 else ("dlrover", "ours"))
                           if s in self.systems]
        got: dict[str, dict[str, Any]] = {}
        timeout = 600 + self.args.mib / 2
        for system in order:
            out = self.run_worker(system, "session", timeout)
            crash = self.run_worker(system, "crash", timeout, agent=True)
            if crash["source"] != "memory" or not crash["correct"]:
                raise RuntimeError(f"{system}: the restore after a crash came from {crash['source']}, "
                                   f"correct={crash['correct']}")
            out["restore_crash"], out["restore_crash_gc"] = crash["restore_crash"], crash["restore_crash_gc"]
            left = [p for p in out.pop("shm_paths") if os.path.exists(p)]
            if left:  # ours and raw remove theirs at close(); DLRover's is counted in clean_dlrover
                self.notes["left_shm"].setdefault(system, []).append(held_bytes(left))
                for path in left:
                    os.unlink(path)
            self.state_bytes = out.pop("state_bytes")
            for metric, value in out.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.add(system, metric, float(value))
            got[system] = out
            os.sync()
            if system == "ours":
                early = self.run_worker("ours", "early", timeout)
                slowest = max(early["early_saves"])
                self.add("ours", "early_save", slowest)
                self.add("ours", "early_save_ratio", slowest / early["warm_save_early"])
                self.notes.setdefault("early_saves", []).append(
                    [round(b / early["warm_save_early"], 2) for b in early["early_saves"]])
                os.sync()
        if "dlrover" in got:
            for metric in ("warm_save", "first_save", "construct", "first_write", "restore", "restore_crash",
                           "commit", "shm_bytes"):
                if got["dlrover"].get(metric) and got["ours"].get(metric) is not None:
                    self.ratios.setdefault(metric, []).append(got["ours"][metric] / got["dlrover"][metric])

    def races(self) -> None:
        self.notes["race"] = {}
        for system in self.systems[1:]:
            trials = self.run_worker(system, "race", 600 + self.args.trials * 120)["race"]
            self.notes["race"][system] = trials

    def standalone_crash(self) -> None:
        """Once: DLRover without dlrover-run's agent, killed and restarted."""
        try:
            out = self.run_worker("dlrover", "crash", 600 + self.args.mib / 2, agent=False)
        except RuntimeError as exc:
            out = {"source": f"nothing ({exc})", "correct": False, "orphan_saver": None}
        self.notes["standalone_crash"] = out

    def close(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


# --- the report ----------------------------------------------------------------------------


ROWS = [
    # (metric, label, raw metric or None)
    ("warm_save", "warm blocking save to memory", "warm_save"),
    ("first_save", "first save in a fresh process (no prepare)", "first_save"),
    ("construct", "construction until the saver answers", None),
    ("first_write", "first write of the live state after construction", "first_write"),
    ("restore", "restore from memory into live tensors, same process", "restore"),
    ("restore_crash", "restore into live tensors, new process after a crash", "restore_crash"),
    ("commit", "call to committed on local disk", "commit"),
    ("shm_bytes", "shared memory held by the job", "shm_bytes"),
    ("shm_bytes_slots1", "shared memory held by the job, ours with slots=1", "shm_bytes"),
]


def spread(values: list[float] | None, fmt: Callable[[float], str]) -> str:
    if not values:
        return "-"
    med = fmt(statistics.median(values))
    if len(values) == 1 or min(values) == max(values):
        return med
    return f"{med} ({fmt(min(values))}–{fmt(max(values))})"


def print_report(run: Run) -> None:
    nbytes = run.state_bytes

    def secs(v: float) -> str:
        return f"{v:.3f} s"

    def mem(v: float) -> str:
        return f"{v / nbytes:.2f}x"

    def ratio(v: float) -> str:
        return f"{v:.2f}"

    print()
    print("| metric | raw limit | DLRover | ours | ours/DLRover |")
    print("|---|---|---|---|---|")
    for metric, label, raw_metric in ROWS:
        fmt = mem if metric.startswith("shm") else secs
        raw = run.samples["raw"].get(raw_metric) if raw_metric else None
        if metric.startswith("shm"):
            raw = [float(nbytes)]
        dl = None if metric == "shm_bytes_slots1" else run.samples["dlrover"].get(metric)
        ratios = run.ratios.get(metric)
        print(f"| {label} | {spread(raw, fmt)} | {spread(dl, fmt)} | {spread(run.samples['ours'].get(metric), fmt)} "
              f"| {spread(ratios, ratio)} |")
    race = run.notes.get("race", {})
    if race:
        cells = {s: (f"{sum(d for d, _ in t)}/{len(t)}", f"{sum(m for _, m in t)}/{len(t)}") for s, t in race.items()}
        dl = cells.get("dlrover", ("-", "-"))
        print(f"| DISK-then-MEMORY race: step N reached storage | - | {dl[0]} | {cells['ours'][0]} | - |")
        print(f"| DISK-then-MEMORY race: step N+1 in memory | - | {dl[1]} | {cells['ours'][1]} | - |")
    early = run.samples["ours"].get("early_save_ratio")
    if early:
        print(f"| slowest of a job's first three saves, before the saver is up (ours/our warm save; target <= 2) "
              f"| - | - | {spread(run.samples['ours']['early_save'], secs)} | {spread(early, ratio)} |")
    print_details(run, secs, mem)


def print_details(run: Run, secs: Callable[[float], str], mem: Callable[[float], str]) -> None:
    s, notes = run.samples, run.notes
    print()
    print(f"Medians (smallest–largest) over {run.args.repeats} repeats; state {nbytes_text(run.state_bytes)} of "
          f"float32 in {run.args.tensors} tensors; torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs.")
    print("details:")
    for system in ("ours", "dlrover"):
        if s[system].get("commit_blocking"):
            print(f"  {system}: blocking part of the persisting save {spread(s[system]['commit_blocking'], secs)}")
    if s["dlrover"].get("commit_fsync"):
        durable = [c + f for c, f in zip(s["dlrover"]["commit"], s["dlrover"]["commit_fsync"])]
        print(f"  dlrover: fsync of the data file its commit skips {spread(s['dlrover']['commit_fsync'], secs)}; "
              f"call to committed and durable {spread(durable, secs)} (ours: the commit row, fsynced)")
    for metric, label, _ in ROWS[:6]:
        spent = {system: s[system].get(metric + "_gc") for system in ("dlrover", "ours")}
        if any(v and statistics.median(v) >= 0.001 for v in spent.values()):
            print(f"  cyclic garbage collection inside '{label}': DLRover {spread(spent['dlrover'], secs)}, "
                  f"ours {spread(spent['ours'], secs)}")
    for system, sizes in notes["left_shm"].items():
        print(f"  {system}: shared memory left after its process exited: {len(sizes)} time(s), "
              f"{spread([float(x) for x in sizes], mem)} of the state (removed by this run)")
    if not notes["left_shm"]:
        print("  shared memory left after the processes exited: none")
    if "dlrover" in run.systems:
        print(f"  dlrover: starts that hung in its saver's startup race: {notes['hung_starts']} of "
              f"{notes['dlrover_starts']} worker runs (its constructor gives up after 60 s; here the worker is "
              f"ended after {START_TIMEOUT_S:.0f} s and run again)")
        print("  dlrover: restore after a crash runs with the saver in a parent process, as under dlrover-run")
    crash = notes.get("standalone_crash")
    if crash:
        print(f"  dlrover without dlrover-run's agent, restarted after SIGKILL: restored from {crash['source']}"
              f" (correct data: {crash['correct']}); the killed trainer's forked saver was still running after the "
              f"restart: {crash['orphan_saver']} (ended by this run)")
    if notes.get("early_saves"):
        print(f"  ours: first three saves before the saver is up, each / the warm save, per repeat: "
              f"{notes['early_saves']} (the saver held back {EARLY_HOLD_S:.0f} s, saves {EARLY_GAP_S} s apart)")
    for system, trials in notes.get("race", {}).items():
        print(f"  race, {system}: (N on storage, N+1 in memory) per trial: {trials}")


def nbytes_text(n: int) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


# --- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=1044.5, help="state size in MiB (default 1044.5: 1.02 GiB)")
    parser.add_argument("--tensors", type=int, default=433, help="number of float32 tensors (default 433)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; medians are reported (default 5)")
    parser.add_argument("--trials", type=int, default=5, help="trials of the DISK-then-MEMORY race (default 5)")
    parser.add_argument("--only", choices=("ours",), help="run the raw limits and our column alone")
    parser.add_argument("--dir", default=None, help="local-disk directory to work in (default /tmp)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds to wait after sync before each persisting save (default 1.0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the samples as JSON to PATH")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.mib <= 0 or args.tensors < 1 or args.repeats < 1 or args.trials < 1:
        parser.error("--mib, --tensors, --repeats and --trials must be positive")
    if args.only != "ours" and not os.access(os.path.join(DLROVER_VENV, "bin", "python"), os.X_OK):
        print(f"DLRover's virtualenv {DLROVER_VENV} is missing: build it with scripts/dlrover-venv.sh "
              "(or run this with --only ours)", file=sys.stderr)
        return 2
    return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    run = Run(args)
    print(f"work dir {run.work}; slots and raw buffers in {run.shm_dir}; {args.repeats} repeats; "
          f"DLRover: {'not run' if 'dlrover' not in run.systems else DLROVER_VENV}", flush=True)
    try:
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            run.repeat(rep)
            print(f"  repeat {rep + 1}/{args.repeats}: {time.perf_counter() - t0:.1f}s", flush=True)
        t0 = time.perf_counter()
        run.races()
        if "dlrover" in run.systems:
            run.standalone_crash()
        print(f"  race and standalone crash: {time.perf_counter() - t0:.1f}s", flush=True)
    finally:
        run.close()
    print_report(run)
    print(f"\ntotal run time {time.perf_counter() - started:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": run.state_bytes, "samples": run.samples, "ratios": run.ratios,
                       "notes": run.notes, "config": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
