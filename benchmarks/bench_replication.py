#!/usr/bin/env python3
"""What peer replicas cost and what they buy: two nodes simulated on this host (two torchrun
agents on loopback, each with its own node id, shared-memory directory and saver).

For ``replicas=0`` and ``replicas=1`` in turn, a job trains ``--steps`` steps (a fixed amount of
compute plus an in-place update of every state tensor, as an optimizer step does), snapshots
every step into memory and persists every ``--persist-every`` steps and the last one. Then node
1 is lost whole (its ranks, its saver, its shared memory), node 0's processes are killed too, and
the job is relaunched: node 1's ranks restore from storage (``replicas=0``) or from node 0's
memory (``replicas=1``). It reports the median and 90th percentile of the training step time and
of the save's blocking time, each rank's restore time on the relaunch, and what each node's
saver sent for its newest copy. With ``--data-parallel`` every rank holds the same state (as
data-parallel replicas do) and a third case runs ``replicas=1`` with the data-parallel reuse off
(``FLASHCKPT_REPLICA_REUSE=0``): the bytes sent per snapshot with and without it. With ``--s3`` a
case ``replicas=0`` checkpoints to an S3-compatible server on loopback (moto, ``tests/s3_server.py``)
instead of the local disk: the restore of node 1's ranks from it, beside the other two.

Each simulated node runs on CPUs of its own (half of those this process may use; ``--cpus-per-node
0``: both nodes share all of them), as real nodes do: a node's saver then competes only with its
own trainers, and its CPU budget for replication rounds (``FLASHCKPT_REPLICA_CPU``, a share of
the node's CPUs) is the one it would have on a node of that size. Rounds are rare (about one per
40 s at 256 MiB per rank on one CPU per node), so a run much shorter than that mostly measures
the first round.

    python benchmarks/bench_replication.py                    # 256 MiB per rank, 1 rank per node, 300 steps
    python benchmarks/bench_replication.py --mib 1024 --steps 40 --json out.json
    python benchmarks/bench_replication.py --data-parallel --mib 256
    python benchmarks/bench_replication.py --mib 1024 --steps 20 --s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


# --- the worker (run under torchrun) ----------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from flashckpt_integrations import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0 if args.data_parallel else rank)
    count = 64
    state = {f"w{i:02d}": torch.randn(args.mib * (1 << 20) // 4 // count, generator=gen) for i in range(count)}
    work = torch.randn(256, 256, generator=gen)
    ck = Checkpointer(args.ckpt, replicas=args.replicas, storage_options=json.loads(args.storage_options))
    out = os.path.join(args.out, f"rank-{rank}.json")
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "run_dir": ck.run_dir}
    if args.load_only:
        ck.client.connect()  # the node's saver is up (a real job starts it at the Checkpointer, off the clock)
        dist.barrier()
        started = time.perf_counter()
        loaded = ck.load(target=state)
        record["load"] = {"seconds": time.perf_counter() - started, "source": loaded and loaded.source,
                          "step": loaded and loaded.step, "fetched": ck.replicas.fetched}
        ck.close()
        _write(out, record)
        dist.destroy_process_group()
        os._exit(0)
    record["steps"] = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        acc = work
        for _ in range(args.matmuls):
            acc = torch.tanh(acc @ work)
        for tensor in state.values():
            tensor.add_(1e-3)
        computed = time.perf_counter()
        dist.barrier()  # the ranks step together, as data-parallel training does
        result = ck.save(step, state, persist=step % args.persist_every == 0 or step == args.steps)
        record["steps"].append({"step": step, "step_s": time.perf_counter() - started,
                                "compute_s": computed - started, "blocking_s": result.blocking_s,
                                "kept": _kept_step(ck.run_dir) if args.replicas else None})
    outcome = ck.wait()
    record["committed"] = outcome is not None and outcome.committed
    _write(out, record)
    open(os.path.join(args.out, f"done-{rank}"), "w").close()
    while True:  # the orchestrator kills the node
        time.sleep(1)


def _kept_step(run_dir: str) -> int | None:
    """The step every node keeps in memory, as the node's saver last reported it (None: none yet)."""
    from flashckpt_integrations.core.replication import STATUS_FILE

    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            return json.load(f).get("kept", {}).get("step")
    except (OSError, ValueError):
        return None


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


# --- the orchestrator ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace, ckpt: str, out: str, shm: list[str], replicas: int,
            load_only: bool, reuse: bool = True, options: dict[str, Any] | None = None) -> list[subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               f"--nproc-per-node={args.nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
               os.path.abspath(__file__), "--worker", "--ckpt", ckpt, "--out", out, "--replicas", str(replicas),
               "--mib", str(args.mib), "--steps", str(args.steps), "--persist-every", str(args.persist_every),
               "--matmuls", str(args.matmuls), "--storage-options", json.dumps(options or {}),
               *(["--load-only"] if load_only else []),
               *(["--data-parallel"] if args.data_parallel else [])]
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_NODE_ID": f"bench-node{node}",
               "FLASHCKPT_SHM_DIR": shm[node], "FLASHCKPT_REPLICA_REUSE": "1" if reuse else "0"}
        cpus = _node_cpus(args.cpus_per_node, node)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True,
                                      preexec_fn=(lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None))
    return procs


def _node_cpus(per_node: int, node: int) -> set[int]:
    """The CPUs node ``node``'s processes (agent, ranks, saver) run on; empty: wherever they like."""
    if per_node <= 0:
        return set()
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2 * per_node:
        raise SystemExit(f"--cpus-per-node {per_node} needs {2 * per_node} CPUs; this process may use "
                         f"{len(available)}. Pass a smaller value, or 0 to share them.")
    return set(available[node * per_node:(node + 1) * per_node])


def _records(out: str, world: int) -> list[dict[str, Any]]:
    found = []
    for rank in range(world):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            found.append(json.load(f))
    return found


def _wait(condition: Any, procs: list[subprocess.Popen], what: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a node exited while waiting for {what}:\n{proc.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _kill(procs: list[subprocess.Popen], records: list[dict[str, Any]]) -> None:
    for rec in records:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    for run_dir in {rec["run_dir"] for rec in records}:
        found = subprocess.run(["pgrep", "-f", f"flashckpt_integrations.core.saver --run-dir {run_dir}"],
                               capture_output=True, text=True).stdout.split()
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _evict(root: str) -> None:
    """Drop the checkpoint's files from the page cache (they are durable, so their pages are clean)."""
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _replica_steps(shm: str, ckpt: str) -> set[tuple[int, int]]:
    from flashckpt_integrations.core.client import job_key
    from flashckpt_integrations.core.replication import list_replicas

    return {(r.rank, r.step) for r in list_replicas(shm, job_key(ckpt))}


def _copies(records: list[dict[str, Any]], nproc: int) -> list[dict[str, Any]]:
    """Each rank's newest copy to the other node, as its saver reported it (``bytes``, ``sent``)."""
    from flashckpt_integrations.core.replication import STATUS_FILE

    copies = []
    for record in records:
        node = record["rank"] // nproc
        try:
            with open(os.path.join(record["run_dir"], STATUS_FILE)) as f:
                sent = json.load(f)["sent"].get(str(record["rank"]), {}).get(str(1 - node), {})
        except (OSError, ValueError, KeyError):
            sent = {}
        copies.append(sent)
    return copies


def run_case(args: argparse.Namespace, base: str, replicas: int, reuse: bool = True, s3: Any = None) -> dict[str, Any]:
    """One case; ``s3``: the S3-compatible server to checkpoint to instead of the local disk."""
    ckpt = os.path.join(base, f"ckpt-r{replicas}")
    options = None
    if s3 is not None:
        ckpt, options = f"s3://{s3.make_bucket(f'bench-{os.path.basename(base).lower()}')}/ckpt", s3.storage_options
    shm_base = tempfile.mkdtemp(prefix=f"flashckpt-bench-r{replicas}-", dir=args.shm_dir)
    shm = [os.path.join(shm_base, f"node{n}") for n in (0, 1)]
    for path in shm:
        os.mkdir(path, 0o700)
    world = 2 * args.nproc
    train_out, load_out = os.path.join(base, f"train-r{replicas}"), os.path.join(base, f"load-r{replicas}")
    procs = _launch(args, ckpt, train_out, shm, replicas, load_only=False, reuse=reuse, options=options)
    records: list[dict[str, Any]] = []
    copies: list[dict[str, Any]] = []
    try:
        _wait(lambda: all(os.path.exists(os.path.join(train_out, f"done-{r}")) for r in range(world)), procs,
              "training")
        records = _records(train_out, world)
        if replicas:
            node1 = set(range(args.nproc, world))
            _wait(lambda: {(r, args.steps) for r in node1} <= _replica_steps(shm[0], ckpt), procs,
                  "node 0 to hold node 1's newest snapshots", timeout=120)
            _wait(lambda: all(c.get("step") == args.steps for c in _copies(records, args.nproc)), procs,
                  "the savers' reports of the newest copies", timeout=120)
            copies = _copies(records, args.nproc)
        _kill(procs, records)
        shutil.rmtree(shm[1])  # node 1 is replaced: none of its memory is left,
        if s3 is None:
            _evict(ckpt)  # and nothing of the checkpoint is in its page cache
        os.mkdir(shm[1], 0o700)
        procs = _launch(args, ckpt, load_out, shm, replicas, load_only=True, reuse=reuse, options=options)
        for proc in procs:
            output, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"the relaunch failed:\n{output[-3000:]}")
        loads = [r["load"] for r in _records(load_out, world)]
    finally:
        _kill(procs, records)
        shutil.rmtree(shm_base, ignore_errors=True)
    return {"replicas": replicas, "reuse": reuse, "s3": s3 is not None,
            "steps": [s for r in records for s in r["steps"][1:]],  # (step 1 makes the slots: not counted)
            "loads": loads, "copies": copies}


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every step of every repeat; each rank's restore times, median over the repeats."""
    steps = [s for run in runs for s in run["steps"]]
    loads = []
    for rank in range(len(runs[0]["loads"])):
        samples = [run["loads"][rank] for run in runs]
        fetches = [s["fetched"]["seconds"] for s in samples if s["fetched"]]
        loads.append({"seconds": statistics.median(s["seconds"] for s in samples), "source": samples[0]["source"],
                      "fetched": {"seconds": statistics.median(fetches)} if fetches else None, "samples": samples})
    copies = [c for run in runs for c in run["copies"] if c.get("bytes")]
    behind = [s["step"] - s["kept"] if s.get("kept") is not None else None for s in steps]
    return {"replicas": runs[0]["replicas"], "reuse": runs[0]["reuse"], "s3": runs[0].get("s3", False),
            "repeats": len(runs),
            **{key: _stats([s[key] for s in steps]) for key in ("step_s", "compute_s", "blocking_s")},
            "loads": loads, "every_step": steps,
            "kept_behind": _stats([b for b in behind if b is not None]) if any(b is not None for b in behind) else None,
            "kept_none": sum(b is None for b in behind) / len(behind),
            "sent_share": statistics.median(c["sent"] / c["bytes"] for c in copies) if copies else None,
            "sent_bytes": statistics.median(c["sent"] for c in copies) if copies else None}


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "mean": statistics.fmean(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="state per rank in MiB (default 256)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--persist-every", type=int, default=10, help="persist every N steps (default 10)")
    parser.add_argument("--matmuls", type=int, default=60, help="256x256 matmuls per step: the compute (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating (default 3)")
    parser.add_argument("--cpus-per-node", type=int, default=max(0, len(os.sched_getaffinity(0)) // 2),
                        help="CPUs of each simulated node, its own (default: half of them each; 0: both nodes "
                             "share every CPU)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the two nodes' shared memory goes")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file")
    parser.add_argument("--data-parallel", action="store_true",
                        help="every rank holds the same state; adds replicas=1 with the data-parallel reuse off")
    parser.add_argument("--s3", action="store_true",
                        help="adds replicas=0 with the checkpoints on an S3-compatible server on loopback (moto)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cases = [(0, True, False), (1, True, False)] + ([(1, False, False)] if args.data_parallel else []) + (
        [(0, True, True)] if args.s3 else [])
    s3 = None
    if args.s3:
        sys.path.insert(0, REPO)
        from tests.s3_server import start_s3_server

        s3 = start_s3_server()
    runs: dict[tuple[int, bool, bool], list[dict[str, Any]]] = {case: [] for case in cases}
    try:
        for repeat in range(args.repeats):  # alternating, so that every case sees the same machine noise
            for case in cases if repeat % 2 == 0 else cases[::-1]:
                base = tempfile.mkdtemp(prefix="flashckpt-bench-replication-", dir=args.dir)
                try:
                    runs[case].append(run_case(args, base, case[0], case[1], s3 if case[2] else None))
                finally:
                    shutil.rmtree(base, ignore_errors=True)
    finally:
        if s3 is not None:
            s3.stop()
    results = [_merge(runs[case]) for case in cases]
    report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "load_only")},
                       "results": results}, f, indent=1)


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    off, on = results[:2]
    print(f"{args.mib} MiB per rank, 2 nodes x {args.nproc} rank(s), {args.steps} steps, a memory snapshot every "
          f"step, persisted every {args.persist_every}; "
          + (f"{args.cpus_per_node} CPU(s) of its own per node" if args.cpus_per_node else
             f"{len(os.sched_getaffinity(0))} CPUs shared by both nodes") + f"; medians of {args.repeats} runs"
          + ("; every rank holds the same state" if args.data_parallel else ""))
    names = [f"replicas={r['replicas']}" + ("" if r["reuse"] else ", no reuse") + (", S3" if r["s3"] else "")
             for r in results]
    print(f"{'':34}" + "".join(f"{name:>22}" for name in names))
    for label, key in (("training step (compute + save)", "step_s"), ("  compute alone", "compute_s"),
                       ("save blocking time", "blocking_s")):
        for stat in ("median", "p90", "mean"):
            print(f"{label + ' ' + stat:34}" + "".join(f"{r[key][stat] * 1e3:>19.1f} ms" for r in results))
    for stat in ("median", "mean"):  # the mean is the throughput: every stall counts
        print(f"{'replicas=0 step time / this, ' + stat:34}" + "".join(
            f"{off['step_s'][stat] / r['step_s'][stat]:>22.3f}" for r in results))
    print(f"{'sent per snapshot (newest copy)':34}" + "".join(
        f"{'-':>22}" if r["sent_bytes"] is None else f"{r['sent_bytes'] / 2**20:>12.2f} MiB ({r['sent_share']:.2%})"
        for r in results))
    print(f"{'kept step: steps behind, median/p90':34}" + "".join(
        f"{'-':>22}" if r["kept_behind"] is None else
        f"{r['kept_behind']['median']:>12.0f} / {r['kept_behind']['p90']:<5.0f}   " for r in results))
    print(f"{'  steps with no kept step yet':34}" + "".join(
        f"{'-':>22}" if r["kept_behind"] is None else f"{r['kept_none']:>22.1%}" for r in results))
    print("restore after node 1 was replaced (its memory gone, the checkpoint files not in its page cache):")
    for rank, (a, b) in enumerate(zip(off["loads"], on["loads"])):
        node = rank // args.nproc
        fetch = f" (the fetch {b['fetched']['seconds']:.3f} s)" if b["fetched"] else ""
        print(f"  rank {rank} (node {node}): {a['seconds']:.3f} s from {a['source']}  vs  {b['seconds']:.3f} s from "
              f"{'peer memory' + fetch if b['fetched'] else 'its own ' + b['source']}")
    for r in results:
        if r["s3"]:
            print("  from the S3-compatible server on loopback (replicas=0): " + ", ".join(
                f"rank {rank} {load['seconds']:.3f} s" for rank, load in enumerate(r["loads"])))


if __name__ == "__main__":
    main()
