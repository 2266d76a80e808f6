"""Run the fault-injection job with a kill at a chosen point, relaunch it, check every invariant.

A case is drawn from a seed: the fault point, which visit of it kills, and (for a trainer
point) which rank dies. The job runs with the fault armed; when a rank dies the launcher
terminates the other one (as torchrun does) and relaunches the job, which resumes from memory
or storage; a killed saver is restarted by the trainers themselves. After the job has finished,
:func:`check` verifies against the deterministic reference:

* every committed step's files (each rank's) read back with their recorded checksums and equal
  the reference state of that step: no committed checkpoint is torn;
* the tracker names the newest committed step, which is the job's last step, and retention left
  exactly the newest ``KEEP_LAST`` committed steps: the newest commit was never deleted;
* every save the job reported committed is committed, or was deleted by retention after newer
  commits: nothing is reported committed that is not;
* the resumed run's final parameters equal the uninterrupted run's.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field

import torch

from flashckpt_integrations._utils.faults import POINTS
from flashckpt_integrations.core.client import job_key
from flashckpt_integrations.core.codecs import read_file
from flashckpt_integrations.core.layout import Layout, commit_record, committed_steps, read_json
from flashckpt_integrations.core.state import Codec
from flashckpt_integrations.core.storage import LocalStorage
from tests.faults.job import KEEP_LAST, JobConfig
from tests.faults.job import entry as job_entry
from tests.helpers import assert_same

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SAVER_POINTS = ("saver.write", "saver.commit", "retention.delete")
CAMPAIGN_POINTS = tuple(p for p in POINTS if p not in ("saver.supersede", "replica.receive"))
"""The points a plain job reaches (a superseding save needs a second attempt: tests/unit/test_lineage.py;
a replica copy needs replication on: tests/distributed/test_replication_savers.py)."""


@dataclass(frozen=True)
class Case:
    seed: int
    point: str
    visit: int
    rank: int
    """The rank whose process is armed (a trainer point kills that rank); -1: both (saver points)."""

    @property
    def spec(self) -> str:
        return f"{self.point}@{self.visit}"


def draw(seed: int, cfg: JobConfig, point: str | None = None) -> Case:
    """The case of ``seed``: its point (``seed`` modulo the points, unless given), visit and rank."""
    rng = random.Random(f"flashckpt-fault-{seed}")  # a string seed is hashed: neighbouring seeds differ
    point = point or CAMPAIGN_POINTS[seed % len(CAMPAIGN_POINTS)]
    visit = rng.randint(1, cfg.hits(point))
    rank = -1 if point in SAVER_POINTS else rng.randrange(cfg.world_size)
    return Case(seed, point, visit, rank)


@dataclass
class Outcome:
    case: Case
    fired: bool = False
    relaunched: bool = False
    source: str | None = None
    """Where the relaunch resumed from: "memory", "storage", None (from scratch or not relaunched)."""
    resumed: int | None = None
    recovery_s: float | None = None
    """From the relaunch until training resumed (process start, gloo, saver, load)."""
    load_s: float | None = None
    """``Checkpointer.load`` alone (slowest rank)."""
    relaunched_at: float = 0.0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    runs: list[float] = field(default_factory=list)
    """Wall time of each launch of the job."""

    @property
    def passed(self) -> bool:
        return self.fired and not self.problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_dir() -> str:
    """A fresh directory with a short path: a saver's socket path must fit in 108 bytes."""
    return tempfile.mkdtemp(prefix="fckpt-")


def job_env(run_base: str, **extra: str) -> dict[str, str]:
    """The environment of a job whose savers keep their run directories under ``run_base``."""
    os.makedirs(run_base, mode=0o700, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "FLASHCKPT_FAULT"}
    return {**env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_RUN_DIR": run_base,
            "FLASHCKPT_SAVER_IDLE_EXIT": "30", **extra}


_FORKSERVER = None


def _context():
    """Ranks fork from a server that imported torch once: a launch costs no torch import.

    The package itself is not imported there, so that each rank reads its own fault knob.
    """
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "torch.nn.functional"])
    return _FORKSERVER


def launch(cfg: JobConfig, ckpt: str, out: str, env: dict[str, str], fault: dict[int, str] | None = None,
           timeout: float = 120.0) -> list[int]:
    """Run the job's ranks like torchrun: once one fails, terminate the others. Return the exit codes."""
    os.makedirs(out, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(cfg.world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(cfg.world_size),
                    "LOCAL_WORLD_SIZE": str(cfg.world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}
        argv = ["--ckpt", ckpt, "--out", out, "--steps", str(cfg.steps), "--persist-every", str(cfg.persist_every),
                "--seed", str(cfg.seed)]
        if fault and fault.get(rank):
            argv += ["--fault", fault[rank]]
        proc = _context().Process(target=job_entry, args=(argv, rank_env, os.path.join(out, f"rank-{rank}.log")))
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + timeout
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            _terminate(procs)
            break
        time.sleep(0.02)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _terminate(procs: list) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def job_run_prefix(run_base: str, ckpt: str) -> str:
    """Where the savers of the job saving to ``ckpt`` keep their run directories (one per node)."""
    return os.path.join(run_base, f"flashckpt-{os.getuid()}", f"{job_key(os.path.abspath(ckpt))}-")


def saver_pids(run_base: str, ckpt: str) -> list[int]:
    """Savers of the job saving to ``ckpt``."""
    pids = []
    needle = f"--run-dir {job_run_prefix(run_base, ckpt)}".encode()
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if needle in f.read().replace(b"\0", b" "):
                    pids.append(int(path.split("/")[2]))
        except OSError:
            continue
    return pids


def stop_savers(run_base: str, ckpt: str) -> None:
    for pid in saver_pids(run_base, ckpt):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_savers(run_base: str, ckpt: str, timeout: float = 60.0) -> bool:
    """Wait until the job's savers have finished what they were given and exited."""
    deadline = time.monotonic() + timeout
    while saver_pids(run_base, ckpt):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def saver_logs(run_base: str, ckpt: str) -> str:
    text = []
    for path in glob.glob(job_run_prefix(run_base, ckpt) + "*/saver.log"):
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "\n".join(text)


def run_case(case: Case, cfg: JobConfig, reference: dict[int, dict], workdir: str,
             run_base: str | None = None) -> Outcome:
    """Run one case in ``workdir`` (fresh), relaunching once after a trainer died; check it."""
    started = time.monotonic()
    outcome = Outcome(case)
    ckpt = os.path.join(workdir, "ckpt")
    own_base = run_base is None
    run_base = run_base or short_dir()
    env = job_env(run_base)
    fault = {r: case.spec for r in range(cfg.world_size) if case.rank in (-1, r)}
    try:
        codes = launch(cfg, ckpt, os.path.join(workdir, "run1"), env, fault)
        outcome.runs.append(time.monotonic() - started)
        out = os.path.join(workdir, "run1")
        if any(codes):
            outcome.fired = case.rank >= 0 and codes[case.rank] == -signal.SIGKILL
            outcome.relaunched = True
            out = os.path.join(workdir, "run2")
            outcome.relaunched_at = time.time()
            codes = launch(cfg, ckpt, out, env)
            outcome.runs.append(time.time() - outcome.relaunched_at)
            if any(codes):
                outcome.problems.append(f"the relaunched job failed with exit codes {codes}")
        if case.rank == -1:
            outcome.fired = f"fault injection: SIGKILL at {case.point}" in saver_logs(run_base, ckpt)
        if not outcome.fired:
            outcome.problems.append(f"the fault {case.spec} never fired")
        if not outcome.problems and not wait_for_savers(run_base, ckpt):
            outcome.problems.append("the saver did not exit after the job had closed")
        if not outcome.problems:
            _read_records(outcome, out, cfg)
        if not outcome.problems:
            outcome.problems += check(ckpt, cfg, reference, out)
    finally:
        stop_savers(run_base, ckpt)
        with open(os.path.join(workdir, "saver.log"), "w") as f:  # kept with the case's directory
            f.write(saver_logs(run_base, ckpt))
        if own_base:
            shutil.rmtree(run_base, ignore_errors=True)
    outcome.seconds = time.monotonic() - started
    return outcome


def _read_records(outcome: Outcome, out: str, cfg: JobConfig) -> None:
    records = []
    for rank in range(cfg.world_size):
        path = os.path.join(out, f"rank-{rank}.json")
        if not os.path.exists(path):
            outcome.problems.append(f"rank {rank} wrote no record in {out}")
            return
        with open(path) as f:
            records.append(json.load(f))
    if outcome.relaunched:
        outcome.source, outcome.resumed = records[0]["source"], records[0]["resumed"]
        outcome.recovery_s = max(r["resumed_at"] for r in records) - outcome.relaunched_at
        outcome.load_s = max(r["load_s"] for r in records)
        if any((r["source"], r["resumed"]) != (outcome.source, outcome.resumed) for r in records):
            outcome.problems.append(f"the ranks resumed from different places: {records}")


def check(ckpt: str, cfg: JobConfig, reference: dict[int, dict], out: str) -> list[str]:
    """Every invariant of the checkpoint directory and the job's records (empty list: all hold)."""
    problems = []
    storage = LocalStorage(ckpt)
    committed = committed_steps(storage)
    layout = Layout()
    for step in committed:
        for rank in range(cfg.world_size):
            try:
                sid = commit_record(storage, step)["sid"]
                entry = read_json(storage, layout.rank_marker(step, rank, sid=sid))["files"][0]
                loaded = read_file(storage, f"{layout.step_path(step)}/{entry['path']}", Codec.TORCH, expected=entry)
                native = torch.load(os.path.join(ckpt, layout.step_path(step), f"rank-{rank}.pt"), weights_only=True)
                assert_same(loaded, {**reference[step], "rank": rank}, f"step {step} rank {rank}")
                assert_same(native, loaded, f"step {step} rank {rank} (torch.load)")
            except Exception as exc:
                problems.append(f"committed step {step} rank {rank} does not hold the reference state: {exc}")
    expected = [s for s in range(1, cfg.steps + 1) if s % cfg.persist_every == 0][-KEEP_LAST:]
    if committed != expected:
        problems.append(f"committed steps {committed}, expected the newest {KEEP_LAST}: {expected}")
    tracker = storage.read("latest").decode().strip() if storage.exists("latest") else None
    if committed and tracker != str(committed[-1]):
        problems.append(f"the tracker names step {tracker}, the newest commit is {committed[-1]}")
    for rank in range(cfg.world_size):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            record = json.load(f)
        for saved in record["persisted"]:
            newer = [s for s in committed if s > saved["step"]]
            if saved["committed"] and saved["step"] not in committed and len(newer) < KEEP_LAST:
                problems.append(f"rank {rank} was told step {saved['step']} is committed; it is not "
                                f"(committed: {committed})")
        if record["final"] is not None and not record["final"]["committed"]:  # None: resumed at the end
            problems.append(f"rank {rank}: the last persist was not committed: {record['final']}")
    shm = os.environ.get("FLASHCKPT_SHM_DIR", "/dev/shm")
    prefix = f"flashckpt-{os.getuid()}-{job_key(os.path.abspath(ckpt))}-"
    left = [n for n in os.listdir(shm) if n.startswith(prefix)] if os.path.isdir(shm) else []
    if left:
        problems.append(f"the job closed cleanly and left shared memory behind: {left}")
    final = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    try:
        assert_same(final, reference[cfg.steps]["model"], "final model")
    except AssertionError as exc:
        problems.append(f"the final parameters differ from the uninterrupted run's: {exc}")
    return problems


def table(outcomes: list[Outcome]) -> str:
    """Per point: cases, passed, failed, where relaunches resumed from, median recovery and load time."""
    import statistics

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}s" if values else "-"

    rows = ["point              cases  passed  failed  memory  storage  scratch  no-relaunch  recovery  load"]
    for point in [*CAMPAIGN_POINTS, None]:
        mine = [o for o in outcomes if point is None or o.case.point == point]
        if not mine:
            continue
        relaunched = [o for o in mine if o.relaunched]
        rows.append(
            f"{point or 'all':<18} {len(mine):>5}  {sum(o.passed for o in mine):>6}  "
            f"{sum(not o.passed for o in mine):>6}  {sum(o.source == 'memory' for o in relaunched):>6}  "
            f"{sum(o.source == 'storage' for o in relaunched):>7}  {sum(o.source is None for o in relaunched):>7}  "
            f"{len(mine) - len(relaunched):>11}  {median([o.recovery_s for o in relaunched if o.recovery_s]):>8}  "
            f"{median([o.load_s for o in relaunched if o.load_s is not None]):>5}"
        )
    return "\n".join(rows)


def describe(outcome: Outcome) -> str:
    c = outcome.case
    where = f"rank {c.rank}" if c.rank >= 0 else "saver"
    resumed = f"resumed step {outcome.resumed} from {outcome.source}" if outcome.relaunched else "no relaunch"
    verdict = "ok" if outcome.passed else "FAILED: " + "; ".join(outcome.problems)
    runs = "+".join(f"{r:.1f}" for r in outcome.runs)
    return f"seed {c.seed}: {c.spec} in {where}, {resumed}, {outcome.seconds:.1f}s (runs {runs}s): {verdict}"
