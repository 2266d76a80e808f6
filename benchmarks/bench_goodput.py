#!/usr/bin/env python3
"""Goodput under failures: one 2-rank CPU training job run for a fixed wall-clock budget while a
seeded exponential process kills it, restarted by its launcher each time.

    python benchmarks/bench_goodput.py --quick                   # a few minutes
    python benchmarks/bench_goodput.py --json out.json           # the sweep: 120 s runs, MTBF 10 20 40 s, 3 repeats
    python benchmarks/bench_goodput.py --model [--from-json out.json] [--storage-gbps 2000]
    python benchmarks/bench_goodput.py --configs none,flashckpt-2node,replicas --mtbf 10 --repeats 1 --budget-s 60

Configurations (``--configs``, default all), round-robin in each repeat (the ceiling once per
repeat, the others once per MTBF):

- ``none``: no checkpointing, no failures: the ceiling.
- ``torch.save``: rank 0 writes ``torch.save`` + fsync (temporary file, then rename) every N steps,
  N at the Young/Daly optimum ``sqrt(2 * C * MTBF)`` for the measured save cost C and step time;
  restarted by ``torchrun --max-restarts``.
- ``flashckpt``: a memory snapshot every k steps, persisted every N steps, under ``flashckpt-run``;
  k and N at their own Young/Daly optima: k for the measured stall of a snapshot (at most 3), N for
  what a persist takes from training (the savers' measured CPU time) against the node losses
  alone, since a process failure resumes from memory (``--snapshot-every``, ``--persist-every``).
- ``flashckpt-2node``: ``flashckpt`` with the same k and N on two simulated nodes, one rank each
  (still 2 ranks in all): a node loss resumes from storage. The baseline for ``replicas``.
- ``replicas``: ``flashckpt-2node`` with ``Checkpointer(..., replicas=1)``: each node's saver keeps
  copies of the other node's rank's snapshots in its own shared memory, so that a lost node's rank
  can resume from its peer's memory: from the newest step that every rank holds in memory or in a
  replica, where that is newer than the newest commit.

Two simulated nodes: one ``flashckpt-run`` per node on this host, each with its own
``FLASHCKPT_NODE_ID``, ``FLASHCKPT_SHM_DIR``, ``FLASHCKPT_RUN_DIR`` and saver, joined by torch
elastic's c10d rendezvous on loopback (``--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d``).
``--node-rank`` is not used: it applies to the static rendezvous only, which cannot take a node that
replaces a lost one (it has no rounds: node rank 0's agent hosts its store, and the workers' process
group keys carry each agent's own restart count, so a replacement agent, at count 0, never meets the
surviving node's rank). Node ranks come from
``flashckpt-run``'s topology order instead (``--topology-switch`` with ``--node-name node0|node1``:
nodes ordered by name), so rank r stays on node r through every restart and a restarted rank finds
its own memory. The rendezvous store is served by the benchmark's driver (``is_host=0`` on both
agents), as a service that outlives any training node would serve it, so either node can be lost.
A dead node leaves the rendezvous once its last heartbeat is ``--rdzv-keep-alive`` old (1 s x 3
attempts here; torch's default is 5 s x 3).

Failures: after each (re)start, once the job has completed its first step, the next failure comes
after an exponential time with mean ``--mtbf`` of training (the clock runs while the job trains).
It SIGKILLs a random rank; a share ``--node-loss`` of the failures are node losses that also kill
the node's saver, empty its shared-memory directory and drop the checkpoint files from the page
cache (a replacement node reads storage cold). The same seed gives every configuration the same
draws. On one node (the first three configurations) the launcher survives a node loss and restarts
the workers. On two nodes a node loss takes the drawn rank's node whole: its launcher (agent), its
warm-start template, its rank and its saver are SIGKILLed, its shared-memory directory emptied, its
run directory removed and the checkpoint files dropped from the page cache; then a replacement
launcher for that node starts at once with the same command, as a cluster would start a new pod.
The surviving node's launcher is not restarted: its rank fails on its next collective with the lost
one (or its agent sees the new node waiting), and torch elastic stops it, rejoins the rendezvous and
starts it again once the lost node's heartbeat has expired and the replacement has joined. A
process failure kills the drawn rank only; both agents then restart their ranks and re-rendezvous.

The budget runs from the job's first completed step (the first start costs every configuration
the same). Goodput = useful steps (the highest step completed within the budget, so redone steps
do not count) / the steps the ceiling completes in the same budget. Per failure: lost work (steps
redone), restart time (kill to the end of the first step after it, and process start to first
step), split into launcher (kill to worker process start), interpreter and imports, process
group, checkpointer (model built, saver connected), load and first step, from timestamps that the
workers record; on two nodes the launcher part holds the c10d rendezvous (torch elastic polls it
once a second) and, after a node loss, the heartbeat expiry and the replacement launcher's start.
The stall per checkpoint is the time the save holds the training loop. The ``model`` column is
``_goodput_model.goodput`` fed with the run's own measured failures, downtimes, mean step time and
commit time, and the lost work it models (half the interval between usable checkpoints; for
``replicas`` after a node loss, the shorter of the storage window and the replica window, the
latter from the times at which the driver saw each replica held by the peer): the check that the
projection at scale rests on a model that explains what was measured here.

Every step is a pure function of (seed, step, rank) and the state restored, so every
configuration must reproduce the ceiling's parameters: rank 0 records a CRC-32 of the parameters
after every step, and each is compared with the ceiling's at the same step (redone steps too).
"""

from __future__ import annotations

import time

WALL0 = time.time()  # the worker's script starts (before torch is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import zlib  # noqa: E402
from typing import Any  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("none", "torch.save", "flashckpt", "flashckpt-2node", "replicas")
FLASH = ("flashckpt", "flashckpt-2node", "replicas")
"""The configurations that checkpoint with flashckpt under ``flashckpt-run``."""
TWO_NODE = ("flashckpt-2node", "replicas")
"""The configurations run on two simulated nodes, rank r on node r."""
WORLD = 2


# --- the worker (one rank, under torchrun or flashckpt-run) -------------------------------------


def _mlp(hidden: int) -> Any:
    """The job's model: 784 -> hidden -> hidden -> 10."""
    from torch import nn

    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _process_start_wall() -> float:
    """Wall-clock time this process was created (10 ms resolution), from /proc."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def worker(args: argparse.Namespace) -> None:
    proc_start = _process_start_wall()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.mode in FLASH:
        from flashckpt_integrations import Checkpointer
    t_imports = time.time()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t_pg = time.time()
    torch.manual_seed(args.seed)
    model = DDP(_mlp(args.hidden))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_model = time.time()  # DDP's constructor also waits for the other rank
    extra = {"replicas": 1} if args.mode == "replicas" else {}
    ck = Checkpointer(args.ckpt, optimizers=[optimizer], **extra) if args.mode in FLASH else None
    t_ck = time.time()
    start, source, tier = 1, "scratch", None
    path = os.path.join(args.ckpt, "model.pt")
    if ck is not None:
        res = ck.load()
        if res is not None:
            state, source, tier = res.state, res.source, res.tiers.get(rank)
    elif args.mode == "torch.save" and os.path.exists(path):
        state, source = torch.load(path, weights_only=True), "storage"
    if source != "scratch":
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    t_load = time.time()
    fd = os.open(os.path.join(args.rec, f"rank-{rank}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(**fields: Any) -> None:
        os.write(fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())

    record(e="start", pid=os.getpid(), resumed=start - 1, source=source, proc=proc_start, py=WALL0,
           imports=t_imports, pg=t_pg, model=t_model, ck=t_ck, load=t_load, **({"tier": tier} if tier else {}))
    params = list(model.module.parameters())
    gen = torch.Generator()
    parent = os.getppid()
    for step in range(start, 1 << 40):
        if step % 50 == 0 and (os.getppid() != parent or time.time() > args.until):
            os._exit(0)  # the launcher is gone or the run is over: never outlive the run
        gen.manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
        x = torch.randn(args.batch_size, 784, generator=gen)
        y = torch.randint(0, 10, (args.batch_size,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if ck is not None and step == start:
            ck.prepare(state)  # sizes the slots off the clock of every later save
        stall = None
        persist = step % args.every == 0
        if persist or ck is not None and step % args.snapshot_every == 0:
            t0 = time.perf_counter()
            if ck is not None:
                result = ck.save(step, state, persist=persist)
                if not result.ok:
                    raise RuntimeError(f"save of step {step} {result.status.value}: {result.reason}")
            elif rank == 0:
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            stall = time.perf_counter() - t0
        if rank == 0:
            crc = 0
            for p in params:
                crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
            record(e="s", s=step, t=time.time(), c=crc, **({"k": stall, "p": int(persist)} if stall else {}))


# --- the driver ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=120.0, help="wall-clock seconds per run")
    p.add_argument("--mtbf", type=float, nargs="+", default=[10.0, 20.0, 40.0], help="seconds of training")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--node-loss", type=float, default=0.25, help="share of failures that lose the node")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--hidden", type=int, default=4096, help="MLP width (4096: 20M parameters, 229 MiB of state)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="--budget-s 30 --mtbf 10 20 40 --repeats 1")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated configurations to run, of {', '.join(CONFIGS)} (default: all); the "
                   "ceiling (none) runs once per repeat whether listed or not: it is every run's reference")
    p.add_argument("--rdzv-keep-alive", type=int, nargs=2, default=[1, 3], metavar=("INTERVAL_S", "ATTEMPTS"),
                   help="two-node configurations: the c10d rendezvous' keep_alive_interval and "
                   "keep_alive_max_attempt (torch's defaults are 5 and 3): a lost node leaves the rendezvous "
                   "once its last heartbeat is INTERVAL_S x ATTEMPTS old, and the job cannot restart before")
    p.add_argument("--json", default=None, help="write every run and the summary here")
    p.add_argument("--plot", default=os.path.join(REPO, "benchmarks", "goodput.png"))
    p.add_argument("--model", action="store_true", help="print the analytic model at 1k-64k GPUs and exit")
    p.add_argument("--from-json", default=None, help="--model: calibrate from this --json output")
    p.add_argument("--storage-gbps", type=float, default=2000.0, help="--model: aggregate storage GB/s")
    # worker options (set by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=CONFIGS, default="none", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=1 << 40, help=argparse.SUPPRESS)
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="flashckpt: a memory snapshot every k steps (default: its Young/Daly optimum, at most 3)")
    p.add_argument("--persist-every", type=int, default=0,
                   help="flashckpt: persist every N steps (default: its Young/Daly optimum for node losses)")
    p.add_argument("--until", type=float, default=float("inf"), help=argparse.SUPPRESS)
    p.add_argument("--probe-persist", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.budget_s, args.mtbf, args.repeats = 30.0, [10.0, 20.0, 40.0], 1
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    args.configs = [c for c in CONFIGS if c in chosen and c != "none"]  # in the table's order
    return args


def _state_and_save_cost(args: argparse.Namespace, where: str) -> tuple[int, float]:
    """Bytes of the training state and the median time of torch.save + fsync of it (rank 0's save)."""
    import torch

    torch.set_num_threads(1)
    state = _probe_state(args)
    path, times = os.path.join(where, "probe.pt"), []
    for _ in range(7):  # as the worker saves: a new file each time, fsynced, renamed over the last
        t0 = time.perf_counter()
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        times.append(time.perf_counter() - t0)
    os.unlink(path)
    size = sum(t.numel() * t.element_size() for t in state["model"].values()) * 3  # params + Adam's two moments
    return size, statistics.median(times[2:])


def _probe_state(args: argparse.Namespace) -> dict[str, Any]:
    """The training state of the job's model (one rank's), after one optimizer step."""
    import torch

    model = _mlp(args.hidden)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def _persist_cost_probe(args: argparse.Namespace) -> None:
    """(Its own process, ``--probe-persist DIR``.) The saver's CPU seconds per persist of the state and
    the time from a persisting save to its commit, printed as JSON."""
    import torch

    from flashckpt_integrations import Checkpointer

    torch.set_num_threads(1)
    state = _probe_state(args)
    ck = Checkpointer(os.path.join(args.probe_persist, "ckpt"))
    ck.prepare(state)
    stalls = []
    for step in range(1, 6):
        t0 = time.perf_counter()
        ck.save(step, state, persist=False)
        stalls.append(time.perf_counter() - t0)
    cpu, commit = [], []
    for step in range(6, 11):
        before, t0 = _savers_cpu(args.probe_persist), time.perf_counter()
        if not ck.save(step, state, persist=True).wait(120).committed:
            raise RuntimeError(f"the probe's persist of step {step} did not commit")
        commit.append(time.perf_counter() - t0)
        cpu.append(_savers_cpu(args.probe_persist) - before)
    ck.close()
    print(json.dumps({"saver_cpu_s": statistics.median(cpu[1:]), "commit_s": statistics.median(commit[1:]),
                      "stall_s": statistics.median(stalls[1:])}))


def _saver_pids(run_dir: str) -> list[int]:
    """The savers whose run directory (``$FLASHCKPT_RUN_DIR``) starts with ``run_dir``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"core.saver" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"FLASHCKPT_RUN_DIR={run_dir}".encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _savers_cpu(run_root: str) -> float:
    """CPU seconds (user + system) used so far by the savers whose run directory is under ``run_root``."""
    total = 0.0
    for pid in _saver_pids(run_root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _persist_cost(args: argparse.Namespace) -> dict[str, float]:
    where = tempfile.mkdtemp(prefix="gp-probe-")
    shm = tempfile.mkdtemp(prefix="gp-probe-", dir="/dev/shm")
    os.makedirs(os.path.join(where, "run"), mode=0o700)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_SHM_DIR": shm,
           "FLASHCKPT_RUN_DIR": os.path.join(where, "run")}
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-persist", where,
                              "--hidden", str(args.hidden)], env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"the persist probe failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _drop_page_cache(root: str) -> None:
    for parent, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _empty(directory: str) -> None:
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


class Run:
    """One launch of the job for ``budget`` seconds, with failures injected; its records parsed.

    The two-node configurations (:data:`TWO_NODE`) run one ``flashckpt-run`` per simulated node,
    node n with rank n, its own ``FLASHCKPT_NODE_ID``, shared-memory directory, run directory and
    saver, all on this host; the c10d rendezvous store is served by this process (as a service
    that outlives any training node would serve it), so that either node can be lost.
    """

    def __init__(self, args: argparse.Namespace, config: str, mtbf: float | None, every: int, seed: int,
                 snapshot_every: int = 1) -> None:
        self.args, self.config, self.mtbf, self.every = args, config, mtbf, every
        self.snapshot_every = snapshot_every
        self.rng = random.Random(seed)
        self.nodes = 2 if config in TWO_NODE else 1
        self.dir = tempfile.mkdtemp(prefix="gp-")  # short: a saver's socket path must fit in 108 bytes
        self.shms = [tempfile.mkdtemp(prefix="gp-", dir="/dev/shm") for _ in range(self.nodes)]
        self.ckpt, self.rec = os.path.join(self.dir, "ckpt"), os.path.join(self.dir, "rec")
        os.makedirs(self.ckpt)
        os.makedirs(self.rec)
        names = ["run"] if self.nodes == 1 else [f"run{n}" for n in range(self.nodes)]
        self.run_dirs = [os.path.join(self.dir, name) for name in names]  # each node's $FLASHCKPT_RUN_DIR
        for run_dir in self.run_dirs:
            os.makedirs(run_dir, mode=0o700)
        self.steps: list[dict] = []  # rank 0's step records, in order
        self.starts: list[list[dict]] = [[] for _ in range(WORLD)]
        self.failures: list[dict] = []
        self._offsets = [0] * WORLD
        self.first_step: float | None = None
        self.commits: dict[int, float] = {}  # flashckpt: step -> when the driver saw it committed
        self.replicated: dict[int, dict[int, float]] = {}  # replicas: rank -> step -> when a peer held it
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []
        self.rdzv_port = 0

    def command(self, node: int = 0) -> list[str]:
        if self.nodes == 1:
            opts = ["--standalone", f"--nproc-per-node={WORLD}", "--max-restarts=100000", "--monitor-interval=0.1"]
        else:  # ranks ordered by node name (flashckpt-run's topology order), so rank n stays on node n
            interval, attempts = self.args.rdzv_keep_alive
            opts = [f"--nnodes={self.nodes}", f"--nproc-per-node={WORLD // self.nodes}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{self.rdzv_port}", f"--rdzv-id={os.path.basename(self.dir)}",
                    f"--rdzv-conf=is_host=0,keep_alive_interval={interval},keep_alive_max_attempt={attempts}",
                    "--local-addr=127.0.0.1", "--topology-switch=s0", f"--node-name=node{node}",
                    "--max-restarts=100000", "--monitor-interval=0.1"]
        if self.config in FLASH:
            launcher = [sys.executable, "-m", "flashckpt_integrations.launcher.run", "--checkpoint-dir", self.ckpt]
        else:
            launcher = [sys.executable, "-m", "torch.distributed.run"]
        return [*launcher, *opts, os.path.abspath(__file__), "--worker", "--mode", self.config, "--ckpt", self.ckpt,
                "--rec", self.rec, "--every", str(self.every), "--hidden", str(self.args.hidden),
                "--batch-size", str(self.args.batch_size), "--seed", str(self.args.seed),
                "--snapshot-every", str(self.snapshot_every), "--until", str(self.t0 + self.args.budget_s + 120)]

    def _launch(self, node: int) -> subprocess.Popen:
        """Start node ``node``'s launcher (its first one, or the replacement of a lost node)."""
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_SHM_DIR": self.shms[node],
               "FLASHCKPT_RUN_DIR": self.run_dirs[node], "FLASHCKPT_SAVER_IDLE_EXIT": "30",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if self.nodes > 1:
            env["FLASHCKPT_NODE_ID"] = f"node{node}"
        return subprocess.Popen(self.command(node), env=env, stdout=self.logs[node], stderr=subprocess.STDOUT,
                                start_new_session=True)

    def _log_name(self, node: int) -> str:
        return os.path.join(self.dir, "launcher.log" if self.nodes == 1 else f"launcher-node{node}.log")

    def _poll(self) -> None:
        for rank in range(WORLD):
            path = os.path.join(self.rec, f"rank-{rank}.jsonl")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self._offsets[rank])
                data = f.read()
            end = data.rfind("\n") + 1
            self._offsets[rank] += len(data[:end].encode())
            for line in data[:end].splitlines():
                r = json.loads(line)
                if r["e"] == "start":
                    self.starts[rank].append(r)
                else:
                    self.steps.append(r)

    def _savers(self) -> list[int]:
        return _saver_pids(f"{self.dir}/run")

    def _poll_commit(self) -> None:
        try:
            with open(os.path.join(self.ckpt, "latest")) as f:
                step = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return
        self.commits.setdefault(step, time.time())

    def _poll_replicas(self, job: str) -> None:
        """replicas: note when each step of rank r is first held, complete, by the other node."""
        from flashckpt_integrations.core.replication import list_replicas

        now = time.time()
        for node, shm in enumerate(self.shms):
            try:
                held = list_replicas(shm, job)
            except OSError:  # the node is being lost just now
                continue
            for replica in held:
                if replica.rank != node:  # a peer's rank (rank r runs on node r), not a kept copy of its own
                    self.replicated.setdefault(replica.rank, {}).setdefault(replica.step, now)

    def _inject(self, clock_start: float) -> None:
        rank, node = self.rng.randrange(WORLD), self.rng.random() < self.args.node_loss
        with_pid = self.starts[rank][-1]["pid"]
        t = time.time()
        if node and self.nodes > 1:
            self._lose_node(rank, with_pid)  # rank r runs on node r
        else:
            os.kill(with_pid, signal.SIGKILL)
        if node and self.nodes == 1:
            for pid in self._savers():
                os.kill(pid, signal.SIGKILL)
            _empty(self.shms[0])
            _drop_page_cache(self.ckpt)  # a replacement node reads storage cold
        self.failures.append({"t": t, "rank": rank, "node": node, "starts": len(self.starts[0]), "clock": clock_start})

    def _lose_node(self, node: int, worker_pid: int) -> None:
        """Node ``node`` goes down whole and a replacement takes its place, as a cluster would do it:
        its launcher (agent), warm-start template, rank and saver SIGKILLed, its shared memory and run
        directory gone, the checkpoint files out of the page cache (the replacement reads storage
        cold); then a new launcher for the node starts with an empty shared-memory and run directory
        and joins the rendezvous. The other node's launcher sees its rank fail (or the new node
        waiting) and restarts it: both re-rendezvous once the lost node's heartbeat has expired."""
        agent = self.procs[node]
        doomed = [worker_pid, *_descendants(agent.pid), *_saver_pids(self.run_dirs[node])]
        _kill([worker_pid])
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill(doomed)
        agent.wait()
        _empty(self.shms[node])
        shutil.rmtree(self.run_dirs[node], ignore_errors=True)
        os.makedirs(self.run_dirs[node], mode=0o700)
        _drop_page_cache(self.ckpt)
        self.procs[node] = self._launch(node)

    def execute(self) -> Run:
        store = None
        if self.nodes > 1:  # the rendezvous store, which no node loss takes down
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self.rdzv_port = store.port
        job = None
        if self.config == "replicas":
            from flashckpt_integrations.core.client import job_id_for, job_key

            job = job_key(job_id_for(self.ckpt, None))
        self.logs = [open(self._log_name(n), "w") for n in range(self.nodes)]  # noqa: SIM115
        self.t0 = time.time()
        self.procs = [self._launch(n) for n in range(self.nodes)]
        deadline, next_failure, next_replica_poll = float("inf"), None, 0.0
        try:
            while time.time() < deadline and all(proc.poll() is None for proc in self.procs):
                time.sleep(0.02)
                self._poll()
                if self.config in FLASH:
                    self._poll_commit()
                if job is not None and time.time() >= next_replica_poll:
                    self._poll_replicas(job)
                    next_replica_poll = time.time() + 0.2
                if self.steps and self.first_step is None:
                    self.first_step = self.steps[0]["t"]  # the budget runs from here: the first start is alike
                    deadline = self.first_step + self.args.budget_s
                if self.first_step is None and time.time() > self.t0 + 120:
                    raise RuntimeError(f"{self.config}: no step completed in 120 s; see {self._log_name(0)}")
                if self.mtbf is None or not self.steps:
                    continue
                # Ready once every rank of the attempt started after the last failure has completed a step
                # (a step of the killed attempt can still end just after the kill).
                latest = [rs[-1]["proc"] for rs in self.starts if rs]
                since = self.failures[-1]["t"] - 0.05 if self.failures else 0.0
                ready = len(latest) == WORLD and min(latest) > since and self.steps[-1]["t"] > max(latest)
                if next_failure is None and ready:
                    clock_start = next(s["t"] for s in self.steps if s["t"] > max(latest))
                    next_failure = clock_start + self.rng.expovariate(1.0 / self.mtbf)
                if next_failure is not None and time.time() >= next_failure:
                    self._inject(clock_start)
                    next_failure = None
        finally:
            exited = [(n, proc.poll()) for n, proc in enumerate(self.procs) if proc.poll() is not None]
            for proc in self.procs:
                below = _descendants(proc.pid)  # the warm-start template and the saver have sessions of their own
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _kill(below)
                proc.wait()
            self._poll()
            _kill(list({r["pid"] for starts in self.starts for r in starts}))  # workers have their own sessions
            _kill(self._savers())
            for log in self.logs:
                log.close()
            self._poll()
            del store
            if exited:
                tails = []
                for n, _ in exited:
                    with open(self._log_name(n)) as f:
                        tails.append(f.read()[-3000:])
                raise RuntimeError(f"{self.config}: the launcher exited early "
                                   f"({', '.join(f'node {n}: {rc}' for n, rc in exited)}):\n" + "\n".join(tails))
            shutil.rmtree(self.dir, ignore_errors=True)
            for shm in self.shms:
                shutil.rmtree(shm, ignore_errors=True)
        return self

    def _model(self, deadline: float, events: list[dict], step_s: float | None, commit_s: float,
               ceiling_steps: int | None, replica: tuple[float, float] | None = None) -> dict[str, Any]:
        """The model of ``_goodput_model.goodput`` fed with this run's own measurements.

        Measured: the failures, each one's downtime (kill until training again: kill to the end of
        the first step after it, less one step), the mean step time (saves and the saver's background
        work included), for flashckpt the time from a persisting save to its commit and, for
        replicas, ``replica`` = (the time from a snapshot until the peer holds its replica, the time
        between successive replicas). Modelled: the work each failure loses, half the interval
        between usable checkpoints in time (the snapshot interval; after a node loss the persist
        interval plus the commit time, or with replicas the replica interval plus the replica's
        lag where that is shorter; the save interval for torch.save), as the projection at scale
        models it.
        """
        if not ceiling_steps or not step_s:
            return {}
        from _goodput_model import goodput

        by_kill = {e["kill"]: e for e in events}
        downtime, lost = 0.0, 0.0
        for f in self.failures:
            e = by_kill.get(f["t"])
            downtime += e["restart_s"] - step_s if e else max(0.0, deadline - f["t"])
            if self.config == "torch.save":
                window = self.every * step_s
            elif f["node"]:
                window = self.every * step_s + 2 * commit_s
                if replica is not None:
                    window = min(window, replica[1] + 2 * replica[0])
            else:
                window = self.snapshot_every * step_s
            lost += window / 2
        n = len(self.failures)
        training = self.args.budget_s - downtime
        if n == 0:
            predicted = 1 + training / step_s
        else:  # per failure: training / n seconds of training, downtime / n of downtime, lost / n redone
            share = goodput(training / n, downtime / n, lost / n, 1.0)
            predicted = 1 + share * self.args.budget_s / step_s
        return {"model_goodput": predicted / ceiling_steps, "modelled_lost_s": lost / n if n else 0.0}

    def _replica_times(self, kills: list[float]) -> tuple[float, float] | None:
        """replicas: the medians of (the time from a step's end on rank 0 until the other node held
        rank r's replica of it, the time between successive replicas of a rank) over both ranks,
        leaving out the gaps that span a failure; None without two replicas in a row."""
        ended: dict[int, list[float]] = {}
        for s in self.steps:  # a redone step ends more than once: its latest end before the replica counts
            ended.setdefault(s["s"], []).append(s["t"])
        lags, gaps = [], []
        for held in self.replicated.values():
            lags += [t - max(e for e in ended[step] if e <= t) for step, t in held.items()
                     if any(e <= t for e in ended.get(step, ()))]
            times = sorted(held.values())
            gaps += [b - a for a, b in zip(times, times[1:]) if not any(a < k < b for k in kills)]
        if not lags or not gaps:
            return None
        return statistics.median(lags), statistics.median(gaps)

    def summary(self, reference: dict[int, int], ceiling_steps: int | None = None) -> dict[str, Any]:
        deadline = self.first_step + self.args.budget_s
        useful = max((s["s"] for s in self.steps if s["t"] <= deadline), default=0)
        checked = [s for s in self.steps if s["s"] in reference]
        events = []
        for f in self.failures:
            starts = [next((r for r in rs if r["proc"] > f["t"] - 0.05), None) for rs in self.starts]
            if None in starts:
                continue  # the budget ended during this restart
            r0, relaunched = starts[0], min(r["proc"] for r in starts)  # no step of the killed attempt ends later
            after = [s for s in self.steps if s["t"] > relaunched]
            if not after:
                continue
            first = after[0]
            last = max((s["s"] for s in self.steps if s["t"] < relaunched), default=0)
            events.append({
                "kill": f["t"], "node": f["node"], "rank": f["rank"], "lost_steps": last - r0["resumed"],
                "source": r0["source"], "tier": starts[f["rank"]].get("tier", starts[f["rank"]]["source"]),
                "restart_s": first["t"] - f["t"], "proc_to_first_step_s": first["t"] - relaunched,
                "launcher_s": relaunched - f["t"], "imports_s": r0["imports"] - r0["proc"],
                "process_group_s": r0["pg"] - r0["imports"], "model_s": r0["model"] - r0["pg"],
                "checkpointer_s": r0["ck"] - r0["model"],
                "load_s": r0["load"] - r0["ck"], "first_step_s": first["t"] - r0["load"]})
        stalls = [s["k"] for s in self.steps if "k" in s]
        kills = [f["t"] for f in self.failures]
        within = [(a, b) for a, b in zip(self.steps, self.steps[1:])
                  if b["s"] == a["s"] + 1 and not any(a["t"] < k < b["t"] for k in kills)]  # one attempt
        times = [b["t"] - a["t"] for a, b in within]
        plain = [b["t"] - a["t"] for a, b in within if "k" not in b]
        clean = statistics.median(plain) if plain else (statistics.median(times) - statistics.median(stalls)
                                                         if times and stalls else None)
        saved_at = {s["s"]: s["t"] for s in self.steps if s.get("p")}
        commit_s = [t - saved_at[step] for step, t in self.commits.items() if step in saved_at and t > saved_at[step]]
        replica = self._replica_times(kills)
        model = self._model(deadline, events, statistics.fmean(times) if times else None,
                            statistics.median(commit_s) if commit_s else 0.0, ceiling_steps, replica)
        return {"config": self.config, "mtbf": self.mtbf, "every": self.every, "useful_steps": useful,
                "own_goodput": useful * clean / self.args.budget_s if clean else None,
                "failures": len(self.failures), "node_losses": sum(f["node"] for f in self.failures),
                "unfinished_restarts": len(self.failures) - len(events), "events": events,
                "stall_s": statistics.median(stalls) if stalls else None,
                "persist_stall_s": statistics.median([s["k"] for s in self.steps if s.get("p")] or [0.0]) or None,
                "step_s": statistics.median(times) if times else None,
                "mean_step_s": statistics.fmean(times) if times else None,
                "commit_s": statistics.median(commit_s) if commit_s else None,
                "replica_lag_s": replica[0] if replica else None, "replica_gap_s": replica[1] if replica else None,
                **model,
                "checked_steps": len(checked), "mismatches": sum(reference[s["s"]] != s["c"] for s in checked)}


def persist_interval(args: argparse.Namespace, config: str, cost: float, mtbf: float, step_s: float) -> int:
    """Steps between saves to storage, each configuration at its Young/Daly optimum sqrt(2 C M).

    torch.save: C the measured save (it blocks the job), M the MTBF. flashckpt (and its two-node
    configurations, replicas included, so that they differ only in where a node loss resumes
    from): C what a persist takes from training, the savers' CPU time per persist spread over the
    host's cores (every core trains here), and M the MTBF of node losses only (MTBF / node-loss
    share): a process failure resumes from memory. ``--persist-every`` overrides the flashckpt one.
    """
    if config in FLASH and args.persist_every:
        return args.persist_every
    if config in FLASH:
        mtbf = mtbf / args.node_loss if args.node_loss > 0 else 100 * mtbf
    return max(1, round(math.sqrt(2 * cost * mtbf) / step_s))


def snapshot_interval(args: argparse.Namespace, stall: float, mtbf: float, step_s: float) -> int:
    """flashckpt's steps between memory snapshots: the Young/Daly optimum for the measured stall of a
    snapshot, at most 3, so that a process failure redoes at most one step on average."""
    if args.snapshot_every:
        return args.snapshot_every
    return min(3, max(1, round(math.sqrt(2 * stall * mtbf) / step_s)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="gp-probe-")
    state_bytes, save_cost = _state_and_save_cost(args, base)
    shutil.rmtree(base, ignore_errors=True)
    probe = _persist_cost(args) if any(c in FLASH for c in args.configs) else {
        "saver_cpu_s": 0.0, "commit_s": 0.0, "stall_s": 0.0}
    persist_cost = probe["saver_cpu_s"] * WORLD / (os.cpu_count() or 1)
    print(f"state {state_bytes / 2**20:.1f} MiB per rank; torch.save+fsync C = {save_cost * 1e3:.1f} ms; "
          f"flashckpt persist: saver CPU {probe['saver_cpu_s'] * 1e3:.0f} ms per rank (C = {persist_cost * 1e3:.0f} ms "
          f"on {os.cpu_count()} cores), committed {probe['commit_s'] * 1e3:.0f} ms after the call; memory snapshot "
          f"{probe['stall_s'] * 1e3:.0f} ms", flush=True)
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    for rep in range(args.repeats):
        ceiling = Run(args, "none", None, 1 << 40, 0).execute()
        reference = {s["s"]: s["c"] for s in ceiling.steps}
        summary = ceiling.summary(reference)
        step_s = summary["step_s"]
        runs.append({**summary, "repeat": rep, "ceiling_steps": summary["useful_steps"]})
        print(f"[{time.monotonic() - started:5.0f}s] repeat {rep} ceiling: {summary['useful_steps']} steps, "
              f"{step_s * 1e3:.1f} ms/step", flush=True)
        for mtbf in args.mtbf:
            for config in args.configs:
                cost = persist_cost if config in FLASH else save_cost
                every = persist_interval(args, config, cost, mtbf, step_s)
                k = snapshot_interval(args, probe["stall_s"], mtbf, step_s)
                seed = args.seed * 7919 + rep * 104_729 + int(mtbf * 1000)
                s = Run(args, config, mtbf, every, seed, k).execute().summary(reference, summary["useful_steps"])
                s["snapshot_every"] = k if config in FLASH else None
                s.update(repeat=rep, ceiling_steps=summary["useful_steps"],
                         goodput=s["useful_steps"] / summary["useful_steps"])
                runs.append(s)
                interval = f"k={k} N={every}" if config in FLASH else f"N={every}"
                print(f"[{time.monotonic() - started:5.0f}s] repeat {rep} {config:15s} MTBF {mtbf:4.0f}s {interval}: "
                      f"goodput {s['goodput']:.3f} (model {s.get('model_goodput', float('nan')):.3f}), "
                      f"{s['failures']} failures, {s['mismatches']} CRC mismatches in {s['checked_steps']} steps",
                      flush=True)
    return {"state_bytes": state_bytes, "torch_save_s": save_cost, "persist_probe": probe,
            "persist_cost_s": persist_cost, "budget_s": args.budget_s,
            "node_loss": args.node_loss, "runs": runs, "seconds": time.monotonic() - started}


def _med(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v is not None]
    return fmt.format(statistics.median(values) * scale) if values else "-"


def interval_text(run: dict[str, Any]) -> str:
    k = run.get("snapshot_every")
    return f"{run['every']}" if k is None else f"{k} / {run['every']}"


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f}" if values else "-"


def _replica_text(rs: list[dict[str, Any]]) -> str:
    lag = _med([r.get("replica_lag_s") for r in rs])
    return "-" if lag == "-" else f"{lag}, {_med([r.get('replica_gap_s') for r in rs])}"


def report(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = ["| config | MTBF s | k / N | goodput (mean ± sd) | model | own-rate goodput | failures | useful steps | "
             "lost steps/failure: process, node (mean) | restart s (kill→step) | proc start→step s | "
             "stall/ckpt ms | persist stall ms | commit s | replica lag, gap s | CRC check |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ceil = [r for r in runs if r["config"] == "none"]
    own = _med([r['own_goodput'] for r in ceil], fmt='{:.3f}')
    useful = _med([r['useful_steps'] for r in ceil], fmt='{:.0f}')
    lines.append(f"| none (ceiling) | - | - | 1.000 | - | {own} | 0 | {useful} | - | - | - | - | - | - | - | "
                 "reference |")
    parts = ("launcher_s", "imports_s", "process_group_s", "model_s", "checkpointer_s", "load_s", "first_step_s")
    breakdown = []
    for config in [c for c in CONFIGS[1:] if any(r["config"] == c for r in runs)]:
        for mtbf in sorted({r["mtbf"] for r in runs if r["config"] == config}):
            rs = [r for r in runs if r["config"] == config and r["mtbf"] == mtbf]
            g = [r["goodput"] for r in rs]
            ev = [e for r in rs for e in r["events"]]
            sd = statistics.stdev(g) if len(g) > 1 else 0.0
            check = "OK" if all(r["mismatches"] == 0 for r in rs) else "MISMATCH"
            check += f" ({sum(r['checked_steps'] for r in rs)} steps)"
            model = [r["model_goodput"] for r in rs if r.get("model_goodput") is not None]
            lost = [_mean([e["lost_steps"] for e in ev if e["node"] == node]) for node in (False, True)]
            lines.append(
                f"| {config} | {mtbf:.0f} | {interval_text(rs[0])} | {statistics.fmean(g):.3f} ± {sd:.3f} | "
                f"{statistics.fmean(model) if model else float('nan'):.3f} | "
                f"{_med([r['own_goodput'] for r in rs], fmt='{:.3f}')} | "
                f"{sum(r['failures'] for r in rs)} ({sum(r['node_losses'] for r in rs)} node, "
                f"{sum(r['unfinished_restarts'] for r in rs)} cut by the budget) | "
                f"{_med([r['useful_steps'] for r in rs], fmt='{:.0f}')} | "
                f"{lost[0]}, {lost[1]} | {_med([e['restart_s'] for e in ev])} | "
                f"{_med([e['proc_to_first_step_s'] for e in ev])} | {_med([r['stall_s'] for r in rs], 1e3)} | "
                f"{_med([r['persist_stall_s'] for r in rs], 1e3)} | {_med([r.get('commit_s') for r in rs])} | "
                f"{_replica_text(rs)} | {check} |")
        ev = [e for r in runs if r["config"] == config for e in r["events"]]
        for kind, sel in (("process", [e for e in ev if not e["node"]]), ("node", [e for e in ev if e["node"]])):
            if sel:
                srcs = sorted({e["tier"] if config in TWO_NODE else e["source"] for e in sel})
                breakdown.append(f"| {config} | {kind} ({len(sel)}) | {'/'.join(srcs)} | " +
                                 " | ".join(_med([e[p] for e in sel]) for p in parts) +
                                 f" | {_med([e['restart_s'] for e in sel])} |")
    lines += ["", "Restart time by part, medians over failures (s):", "",
              "| config | failure (n) | resumed from | launcher | interpreter+imports | process group | "
              "model+DDP | checkpointer | load | first step | total |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
              *breakdown]
    lines += ["", "goodput: useful steps / the ceiling's steps in the same repeat. model: _goodput_model.goodput fed "
              "with the run's measured failures, downtimes, mean step time and commit time, the lost work modelled "
              "(half the interval between usable checkpoints). own-rate goodput: useful steps x "
              "this run's median step time without a save / the budget (the share of the budget spent on steps "
              "that count, at the run's own speed: on a shared host it does not see the load drift between runs). "
              "replica lag, gap (replicas): medians of the time from a step's end until the other node holds its "
              "replica, and of the time between successive replicas of a rank. resumed from: for the two-node "
              "configurations, the tier that served the failed rank (memory: its own node's; replica: the other "
              "node's copy; storage)."]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for config, marker in zip([c for c in CONFIGS[1:] if any(r["config"] == c for r in runs)], "os^Dv"):
        mtbfs = sorted({r["mtbf"] for r in runs if r["config"] == config})
        g = [[r["goodput"] for r in runs if r["config"] == config and r["mtbf"] == m] for m in mtbfs]
        ax.errorbar(mtbfs, [statistics.fmean(x) for x in g], [statistics.stdev(x) if len(x) > 1 else 0 for x in g],
                    marker=marker, capsize=3, label=config)
    ax.axhline(1.0, color="grey", linestyle="--", label="none (ceiling)")
    ax.set_xscale("log")
    ticks = sorted({r["mtbf"] for r in runs if r["mtbf"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("MTBF (s of training)")
    ax.set_ylabel("goodput (useful steps / ceiling)")
    ax.set_title(f"2 ranks, CPU, {result['budget_s']:.0f} s runs, {result['node_loss']:.0%} node losses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def two_node_note(args: argparse.Namespace) -> str:
    interval, attempts = args.rdzv_keep_alive
    return (f"flashckpt-2node and replicas run two simulated nodes on this host, one flashckpt-run each (c10d "
            f"rendezvous, keep-alive {interval} s x {attempts}): a node loss restarts only once the lost node's "
            f"last heartbeat is {interval * attempts} s old and the replacement launcher has started, and both "
            "nodes' launchers, savers and replica copies share this host's cores with the training they measure. "
            "At scale, --model projects them.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.probe_persist:
        _persist_cost_probe(args)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the run's processes on the way out
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _goodput_model import print_model

    if args.model:
        calib = None
        if args.from_json:
            with open(args.from_json) as f:
                calib = json.load(f)
        print_model(calib, args.storage_gbps)
        return 0
    result = measure(args)
    print()
    print(report(result))
    if any(c in TWO_NODE for c in args.configs):
        print()
        print(two_node_note(args))
    bad = [r for r in result["runs"] if r["mismatches"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    try:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    except ImportError:
        print("plot skipped: pip install matplotlib")
    print(f"{len(result['runs'])} runs in {result['seconds']:.0f} s; "
          f"parameters {'differ from the ceiling in ' + str(len(bad)) + ' runs' if bad else 'match the ceiling'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
