"""Node-loss campaign: a job on two nodes loses one of them whole at a random step, mid-training,
and is relaunched; does it come back, from where, and with what lost?

Two nodes are simulated on this host (two torchrun agents on loopback, one rank each, each with
its own ``FLASHCKPT_NODE_ID``, shared-memory directory, run directory and saver), running
``tests/distributed/replica_worker.py`` (data parallel, ``Checkpointer(dir, replicas=1)``, about
36 MiB of state per rank). Each trial:

1. starts the job and waits until it has trained a random number of steps (a third to four fifths
   of the run);
2. loses node 1 whole: its agent, rank and saver SIGKILLed, its shared memory and run directory
   wiped. Node 0's rank then fails on its next collective and its agent ends (a hang is counted
   when it has not ended 30 s after the loss; it is then killed, as a cluster would). Node 0's
   saver and memory are left as a surviving node leaves them;
3. relaunches the same command on both nodes (node 1 empty; steps then take 0.02 s: the relaunch
   only has to finish) and compares each rank's final parameters with an uninterrupted run's, bit
   for bit.

Counted per trial: the newest snapshot every rank held when node 1 was lost (``snapshot``), the
newest committed step then (``commit``), the newest step of rank 1 (the lost node's) that node 0
held a whole replica of (``replica``), the step the relaunch resumed from and the tier that served
each rank (``memory``: its own node's slots; ``replica``: a peer's copy; ``storage``), the steps
lost (``snapshot - resumed``), hangs, failed relaunches, final states that differ.

Configurations (``--configs``):

- ``every-step-p5``: a snapshot every step, a persist every 5 steps, steps of 0.5 s;
- ``every-step-p20``: a snapshot every step, a persist every 20 steps, steps of 0.5 s (the
  issue's realistic cadence);
- ``readme``: the README's engine example, a snapshot every 5 steps and a persist every 10, steps
  of 0.5 s.

    python benchmarks/campaign_node_loss.py --trials 14 --json benchmarks/node-loss.json
    python benchmarks/campaign_node_loss.py --table benchmarks/node-loss.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from flashckpt_integrations.core.replication import list_replicas  # noqa: E402
from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402
from tests.distributed.replica_worker import reference  # noqa: E402
from tests.helpers import savers_with_shm_dir  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "distributed", "replica_worker.py")
STEPS = 50
BALLAST_MIB = 36
"""The state per rank: a buffer of this size beside a small model (large matrix products are not
bit-reproducible across processes, element-wise updates are)."""
EXIT_BOUND_S = 30.0
"""Node 0's launcher not ended this long after the loss counts as a hang."""
RELAUNCH_STEP_SLEEP = 0.02

CONFIGS = {
    "every-step-p5": {"snapshot_every": 1, "persist_every": 5, "step_sleep": 0.5},
    "every-step-p20": {"snapshot_every": 1, "persist_every": 20, "step_sleep": 0.5},
    "readme": {"snapshot_every": 5, "persist_every": 10, "step_sleep": 0.5},
}


def command(config: dict, ckpt: str, out: str, port: int, node: int, sleep: float) -> list[str]:
    return torchrun_cmd(1, port, nnodes=2, node_rank=node) + [
        SCRIPT, "--ckpt", ckpt, "--out", out, "--steps", str(STEPS), "--ballast-mib", str(BALLAST_MIB),
        "--snapshot-every", str(config["snapshot_every"]), "--persist-every", str(config["persist_every"]),
        "--step-sleep", str(sleep), "--print-steps", "--dump-loaded"]


def launch(config: dict, ckpt: str, out: str, shm: list[str], sleep: float, logs: list) -> list[subprocess.Popen]:
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "FLASHCKPT_NODE_ID": f"node{node}",
               "FLASHCKPT_SHM_DIR": shm[node], "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        procs.append(subprocess.Popen(command(config, ckpt, out, port, node, sleep), env=env, stdout=subprocess.PIPE,
                                      stderr=logs[node], text=True, cwd=REPO, start_new_session=True))
    return procs


def rank_record(out: str, rank: int) -> dict:
    with contextlib.suppress(OSError, ValueError), open(os.path.join(out, f"rank-{rank}.json")) as f:
        return json.load(f)
    return {}


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def newest_commit(ckpt: str) -> int:
    steps = [int(os.path.basename(os.path.dirname(p)))
             for p in glob.glob(os.path.join(ckpt, ".flashckpt", "steps", "*", "COMMITTED"))]
    return max(steps, default=0)


def peer_replica(shm: str, ckpt: str, rank: int) -> int | None:
    """The newest step of ``rank`` that the node of ``shm`` holds a whole copy of from a peer."""
    from flashckpt_integrations.core.client import job_key

    steps = [r.step for r in list_replicas(shm, job_key(ckpt)) if r.rank == rank and r.from_node != 0]
    return max(steps, default=None)


def trial(name: str, rng: random.Random, base: str, expected: dict, keep: bool = False) -> dict:
    config = CONFIGS[name]
    work = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
    shm = [tempfile.mkdtemp(prefix=f"flashckpt-nodeloss{n}-", dir="/dev/shm") for n in (0, 1)]
    ckpt, out1, out2 = (os.path.join(work, d) for d in ("ckpt", "run1", "run2"))
    logs = [open(os.path.join(work, f"node{n}.log"), "w+") for n in (0, 1)]  # noqa: SIM115
    lose_at = rng.randint(STEPS // 3, 4 * STEPS // 5)
    first = launch(config, ckpt, out1, shm, config["step_sleep"], logs)
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(json.loads(x) for x in first[0].stdout
                                                         if x.startswith('{"at"')), daemon=True)
    reader.start()
    started = time.monotonic()
    while not (seen and seen[-1]["at"] >= lose_at) and first[0].poll() is None and time.monotonic() - started < 300:
        time.sleep(0.01)
    # node 1 is lost whole: its rank, its agent, its saver, its memory and its run directory
    lost_rec = rank_record(out1, 1)
    kill_all([lost_rec.get("pid", 0)] if lost_rec else [])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(first[1].pid, signal.SIGKILL)
    kill_all(savers_with_shm_dir(shm[1]))
    lost = time.monotonic()
    snapshots = [s["snapshot"] for s in seen if s["snapshot"] is not None]
    row = {"config": name, "at": seen[-1]["at"] if seen else 0, "snapshot": max(snapshots, default=0),
           "commit": newest_commit(ckpt), "replica": peer_replica(shm[0], ckpt, 1)}
    shutil.rmtree(shm[1], ignore_errors=True)
    if lost_rec.get("run_dir"):
        shutil.rmtree(lost_rec["run_dir"], ignore_errors=True)
    first[1].wait(30)
    try:
        first[0].wait(EXIT_BOUND_S)
        row["hang"] = False
    except subprocess.TimeoutExpired:
        row["hang"] = True
        kill_all([rank_record(out1, 0).get("pid", 0)])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first[0].pid, signal.SIGKILL)
        first[0].wait(30)
    row["exit_s"] = round(time.monotonic() - lost, 1)
    row["replica_after_exit"] = peer_replica(shm[0], ckpt, 1)

    shm[1] = tempfile.mkdtemp(prefix="flashckpt-nodeloss1-", dir="/dev/shm")  # the replacement node: no memory
    relaunched = time.monotonic()
    second = launch(config, ckpt, out2, shm, RELAUNCH_STEP_SLEEP, logs)
    codes = []
    for proc in second:
        try:
            proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        codes.append(proc.returncode)
    row["relaunch_s"] = round(time.monotonic() - relaunched, 1)
    row["completed"] = codes == [0, 0]
    records = [rank_record(out2, r) for r in (0, 1)]
    load = records[0].get("load") or {}
    row["resumed"] = load.get("step") or 0
    row["tiers"] = load.get("tiers")
    row["restore_s"] = [round((r.get("load") or {}).get("seconds", 0.0), 2) for r in records]
    row["lost"] = max(0, row["snapshot"] - row["resumed"])
    try:
        at_resume = reference(row["resumed"], 2, ballast_mib=BALLAST_MIB)
        row["restored_equal"] = [all(torch.equal(torch.load(os.path.join(out2, f"loaded-{r}.pt"))[k], v)
                                     for k, v in at_resume.items()) for r in (0, 1)]
        row["equal"] = all(torch.equal(torch.load(os.path.join(out2, f"final-{r}.pt"))[k], v)
                           for r in (0, 1) for k, v in expected.items())
    except OSError as exc:
        row["equal"] = False
        row["error"] = f"{type(exc).__name__}: {exc}"
    if not row["completed"] or not row["equal"] or row["hang"]:
        tails = []
        for node, log in enumerate(logs):
            log.seek(0)
            tails.append(f"node {node}: " + log.read()[-2500:])
        row["logs"] = tails
    for log in logs:
        log.close()
    for directory in shm:
        kill_all(savers_with_shm_dir(directory))
        shutil.rmtree(directory, ignore_errors=True)
    for rec in [lost_rec, *records]:
        if rec.get("run_dir") and not keep:
            shutil.rmtree(rec["run_dir"], ignore_errors=True)
    if keep:
        row["work"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    """Per configuration: trials, hangs, failed relaunches, restored or final states that differ from
    an uninterrupted run's, where rank 1
    (the lost node's) resumed from, and the steps lost against the newest snapshot at the loss."""
    by = collections.defaultdict(list)
    for row in rows:
        by[row["config"]].append(row)
    lines = ["| configuration | trials | hangs | relaunch failed | restored or final state differs | "
             "a replica newer than the newest commit | lost node resumed from peer memory | "
             "... where such a replica was held | steps lost: median (max) | node 0 ended after the loss: max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, group in by.items():
        held = [r for r in group if r["replica"] is not None and r["replica"] > r["commit"]]
        peer = [r for r in group if (r.get("tiers") or {}).get("1") == "replica"]
        held_peer = [r for r in held if (r.get("tiers") or {}).get("1") == "replica"]
        lost = [r["lost"] for r in group]
        differs = sum(not r["equal"] or not all(r.get("restored_equal") or [False]) for r in group)
        lines.append(
            f"| {name} | {len(group)} | {sum(r['hang'] for r in group)} | {sum(not r['completed'] for r in group)} | "
            f"{differs} | {len(held)} | {len(peer)} of {len(group)} | "
            f"{len(held_peer)} of {len(held)} | {statistics.median(lost):g} ({max(lost)}) | "
            f"{max(r['exit_s'] for r in group):.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=14, help="per configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every trial here")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory (and say where)")
    parser.add_argument("--table", help="print the table of an earlier run's --json file and exit")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="campaign-node-loss-")
    expected = reference(STEPS, 2, ballast_mib=BALLAST_MIB)
    names = args.configs.split(",")
    rows = []
    order = [n for _ in range(args.trials) for n in names]
    for i, name in enumerate(order):
        row = trial(name, rng, base, expected, args.keep)
        rows.append(row)
        print(f"[{i + 1}/{len(order)}] {json.dumps({k: v for k, v in row.items() if k != 'logs'})}", flush=True)
        if "logs" in row:
            print("\n".join(row["logs"]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print()
    print(table(rows))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
