"""Preemption campaign: SIGTERM at a random step, SIGKILL when the grace period is over, the node's
memory and run directory gone, then the same command again; every configuration below, at graces of
3 s and 10 s.

Each trial starts a job on one node (its own shared-memory and run directories; 80 steps of 0.3 s
each, so that no job ends within a grace), waits until it has trained a random number of steps
(4 to 20), sends SIGTERM the way the configuration's cluster delivers it
(``all``: every process of the job, the savers too, as Slurm and ``kill`` do; ``agent``: the
launcher only, as Kubernetes does to a container's first process), SIGKILLs whatever is left when the
grace is over (with ``agent``, as soon as the launcher exits: the container, the saver in it, goes
with its first process), wipes the node's memory and run directory, and relaunches the same command to the
end (with steps of 0.02 s). Counted per trial: the newest step a restart could have resumed from when SIGTERM came (the
newest snapshot in memory, or for the stock Trainer its newest checkpoint folder), the step the
relaunch resumed from, the steps lost beyond that snapshot (``max(0, snapshot - resumed)``), whether
the relaunch completed, and whether its final parameters equal an uninterrupted run's, bit for bit.

Configurations:

- ``stock-jit``: ``transformers.Trainer`` with ``enable_jit_checkpoint`` (checkpoints every 20
  steps), what a user has without us; SIGTERM to every process.
- ``flash-hf``: ``FlashCkptTrainer``, a memory snapshot every 5 steps, a persist every 20.
- ``flash-hf-jit``: the same with ``enable_jit_checkpoint``.
- ``engine-all``: the engine API under plain torchrun, 2 ranks, a snapshot every step, a persist
  every 10; SIGTERM to every process.
- ``engine-agent``: the same, SIGTERM to torchrun only (it passes SIGTERM on to its workers).
- ``engine-stopsignal``: ``engine-all`` with :class:`~flashckpt_integrations.StopSignal` in the loop.
- ``engine-agent-stopsignal``: ``engine-agent`` with ``StopSignal`` in the loop (torchrun passes
  SIGTERM on to its workers and waits for them).
- ``flashckpt-run``: the engine API under ``flashckpt-run``, SIGTERM to the launcher only.

    python benchmarks/campaign_preemption.py --trials 10 --json benchmarks/preemption.json
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
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402
from tests.distributed.replica_worker import reference  # noqa: E402
from tests.helpers import savers_with_shm_dir  # noqa: E402

HF_SCRIPT = os.path.join(REPO, "tests", "hf", "example_script.py")
ENGINE_SCRIPT = os.path.join(REPO, "tests", "distributed", "replica_worker.py")
HF_STEPS, ENGINE_STEPS = 80, 80
STEP_SLEEP, RELAUNCH_STEP_SLEEP = 0.3, 0.02
"""Seconds each step sleeps: a job outlives any grace here; the relaunch only has to finish."""

CONFIGS = {
    "stock-jit": {"kind": "hf", "args": ["--stock", "True", "--enable_jit_checkpoint", "True"], "term": "all"},
    "flash-hf": {"kind": "hf", "args": ["--flash_memory_interval", "5"], "term": "all"},
    "flash-hf-jit": {"kind": "hf", "args": ["--flash_memory_interval", "5", "--enable_jit_checkpoint", "True"],
                     "term": "all"},
    "engine-all": {"kind": "engine", "launcher": "torchrun", "term": "all", "args": []},
    "engine-agent": {"kind": "engine", "launcher": "torchrun", "term": "agent", "args": []},
    "engine-stopsignal": {"kind": "engine", "launcher": "torchrun", "term": "all",
                          "args": ["--last-save-on-sigterm"]},
    "engine-agent-stopsignal": {"kind": "engine", "launcher": "torchrun", "term": "agent",
                                "args": ["--last-save-on-sigterm"]},
    "flashckpt-run": {"kind": "engine", "launcher": "flashckpt-run", "term": "agent", "args": []},
}


def hf_command(out: str, extra: list[str], *, resume: bool, result: str | None = None,
               sleep: float = STEP_SLEEP) -> list[str]:
    cmd = [sys.executable, HF_SCRIPT, "--output_dir", out, "--max_steps", str(HF_STEPS), "--save_steps", "20",
           "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "42",
           "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True", "--dataloader_num_workers", "0",
           "--step_sleep", str(sleep), *extra]
    if resume:
        cmd += ["--resume_from_checkpoint", "True"]
    if result:
        cmd += ["--result", result]
    return cmd


def engine_command(config: dict, ckpt: str, out: str, sleep: float = STEP_SLEEP) -> list[str]:
    script = [ENGINE_SCRIPT, "--ckpt", ckpt, "--out", out, "--steps", str(ENGINE_STEPS), "--persist-every", "10",
              "--replicas", "0", "--step-sleep", str(sleep), "--print-steps", *config["args"]]
    port = free_port()
    if config["launcher"] == "torchrun":
        return torchrun_cmd(2, port) + script
    return [os.path.join(os.path.dirname(sys.executable), "flashckpt-run"), "--checkpoint-dir", ckpt,
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *script]


def savers(shm: str) -> list[int]:
    """The savers started with this trial's shared-memory directory."""
    return savers_with_shm_dir(shm)


def worker_pids(out: str) -> list[int]:
    pids = []
    for path in glob.glob(os.path.join(out, "rank-*.json")):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            pids.append(json.load(f)["pid"])
    return pids


def kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def trial(name: str, grace: float, rng: random.Random, base: str, hf_final: dict, keep: bool = False) -> dict:
    config = CONFIGS[name]
    work = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
    shm = tempfile.mkdtemp(prefix="flashckpt-campaign-", dir="/dev/shm")
    run_dir = tempfile.mkdtemp(prefix="fr-", dir="/tmp")  # short: a Unix socket's path has at most 107 bytes
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "FLASHCKPT_SHM_DIR": shm, "FLASHCKPT_RUN_DIR": run_dir, "FLASHCKPT_GRACE_S": str(grace),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    ckpt, out1, out2 = (os.path.join(work, d) for d in ("ckpt", "run1", "run2"))
    os.makedirs(out1)
    os.makedirs(out2)
    if config["kind"] == "hf":
        first = hf_command(ckpt, config["args"], resume=True)
        again = hf_command(ckpt, config["args"], resume=True, result=os.path.join(work, "final.pt"),
                           sleep=RELAUNCH_STEP_SLEEP)
    else:
        first, again = engine_command(config, ckpt, out1), engine_command(config, ckpt, out2, RELAUNCH_STEP_SLEEP)
    stop_after = rng.randint(4, 20)
    log = open(os.path.join(work, "first.log"), "w+")  # noqa: SIM115 (read back below)
    proc = subprocess.Popen(first, env=env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                            start_new_session=True)
    seen: list[dict] = []  # progress lines, read on a thread of their own (the job may outlive the grace)
    reader = threading.Thread(target=lambda: seen.extend(json.loads(x) for x in proc.stdout if x.startswith('{"at"')),
                              daemon=True)
    reader.start()
    started = time.monotonic()
    while not (seen and seen[-1]["at"] >= stop_after) and proc.poll() is None and time.monotonic() - started < 300:
        time.sleep(0.01)
    if config["term"] == "all":
        kill([proc.pid, *worker_pids(out1), *savers(shm)], signal.SIGTERM)
    else:
        kill([proc.pid], signal.SIGTERM)
    stopped = time.monotonic()
    at, snapshot = (seen[-1]["at"], seen[-1]["snapshot"]) if seen else (0, None)
    # ``agent``: the launcher is the container's first process; once it exits, the kernel kills
    # everything else in the container, the saver too.
    while time.monotonic() - stopped < grace and proc.poll() is None or (
            config["term"] == "all" and time.monotonic() - stopped < grace and savers(shm)):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill([proc.pid, *worker_pids(out1), *savers(shm)], signal.SIGKILL)
    proc.wait(30)
    shutil.rmtree(shm, ignore_errors=True)  # the node is gone: its memory and its run directory
    shutil.rmtree(run_dir, ignore_errors=True)
    shm = tempfile.mkdtemp(prefix="flashckpt-campaign-", dir="/dev/shm")
    os.makedirs(run_dir, mode=0o700)
    env.update(FLASHCKPT_SHM_DIR=shm)

    relaunch = subprocess.run(again, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    row = {"config": name, "grace": grace, "at": at, "snapshot": snapshot, "completed": relaunch.returncode == 0}
    if not seen:  # the job never trained a step: say why
        log.seek(0)
        row["first_stderr"] = log.read()[:3000]
    log.close()
    try:
        if config["kind"] == "hf":
            begin = next(json.loads(x) for x in relaunch.stdout.splitlines() if x.startswith('{"resumed_from"'))
            row["resumed"] = begin["start_step"]
            final = torch.load(os.path.join(work, "final.pt"))
            row["equal"] = all(torch.equal(final[k], v) for k, v in hf_final.items())
        else:
            with open(os.path.join(out2, "rank-0.json")) as f:
                row["resumed"] = json.load(f)["load"]["step"] or 0
            expected = reference(ENGINE_STEPS, 2)
            row["equal"] = all(torch.equal(torch.load(os.path.join(out2, f"final-{r}.pt"))[k], v)
                               for r in (0, 1) for k, v in expected.items())
    except (StopIteration, OSError, KeyError) as exc:
        row.update(resumed=None, equal=False, error=f"{type(exc).__name__}: {exc}",
                   stderr=relaunch.stderr[-2000:])
    row["lost"] = max(0, (snapshot or 0) - (row["resumed"] or 0)) if row["resumed"] is not None else None
    kill(savers(shm), signal.SIGKILL)
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    if keep:
        row["work"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    """The campaign's table: per configuration and grace, the steps lost beyond the newest snapshot
    at SIGTERM, the steps redone (trained before SIGTERM, trained again after the relaunch), relaunches
    that failed and final states that differ from the uninterrupted run."""
    by = collections.defaultdict(list)
    for row in rows:
        by[(row["config"], row["grace"])].append(row)
    lines = ["| configuration | grace | trials | steps lost beyond the newest snapshot: max (total) | "
             "steps redone: median (max) | relaunch failed | final state differs |",
             "|---|---|---|---|---|---|---|"]
    for (name, grace), group in by.items():
        lost = [r["lost"] for r in group if r["lost"] is not None]
        redone = sorted(max(0, r["at"] - r["resumed"]) for r in group if r["resumed"] is not None)
        median = redone[len(redone) // 2] if redone else "-"
        lines.append(f"| {name} | {grace:g} s | {len(group)} | {max(lost, default='-')} ({sum(lost)}) | "
                     f"{median} ({max(redone, default='-')}) | {sum(not r['completed'] for r in group)} | "
                     f"{sum(not r['equal'] for r in group)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="per configuration and grace")
    parser.add_argument("--graces", default="3,10")
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
    base = tempfile.mkdtemp(prefix="campaign-preemption-")
    graces = [float(g) for g in args.graces.split(",")]
    names = args.configs.split(",")
    hf_final = {}
    if any(CONFIGS[n]["kind"] == "hf" for n in names):  # the uninterrupted run every HF relaunch must end at
        out = os.path.join(base, "reference")
        cmd = hf_command(out, ["--stock", "True"], resume=False, result=os.path.join(base, "reference.pt"),
                         sleep=0)
        subprocess.run(cmd, env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                       check=True, cwd=REPO,
                       capture_output=True)
        hf_final = torch.load(os.path.join(base, "reference.pt"))
    rows = []
    order = [(n, g) for _ in range(args.trials) for n in names for g in graces]
    for i, (name, grace) in enumerate(order):
        row = trial(name, grace, rng, base, hf_final, args.keep)
        rows.append(row)
        print(f"[{i + 1}/{len(order)}] {json.dumps({k: v for k, v in row.items() if k != 'stderr'})}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print()
    print(table(rows))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
