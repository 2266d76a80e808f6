"""Kill a Megatron-LM ``pretrain()`` job right after a memory-only snapshot, relaunch it, check it resumed from memory.

    .venv-megatron/bin/python examples/megatron/demo.py [--workdir DIR] [--reference]

1. runs ``pretrain_gpt.py`` under torchrun (2 data-parallel ranks; CPU + gloo without a GPU) for 12
   iterations: a memory snapshot every 2 iterations, persisted to disk every 4. Every rank is
   SIGKILLed right after the (memory-only) save of iteration 6; the newest iteration on disk is 4;
2. relaunches the same command: Megatron's ``load_checkpoint`` must resume from shared memory at
   iteration 6 (newer than the disk's 4), and the run must train to iteration 12 and commit it;
3. with ``--reference``: runs the same training uninterrupted in another directory; the final
   loss of both runs must be the same. (Megatron's logged ``lm loss`` of the second iteration of
   each launch is the mean of the launch's first two iterations, so the logs of the two runs
   differ at iteration 8; the losses the forward step computes do not.)

Run it with a Python that has torch and megatron-core 0.19 (e.g. this repository's
``.venv-megatron``); it starts torchrun itself. Prints "demo OK" at the end, or "demo FAILED" and
exits non-zero.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "pretrain_gpt.py")

TRAIN_ITERS, SNAPSHOT_EVERY, PERSIST_EVERY, KILL_AT = 12, 2, 4, 6
LAST_PERSISTED = KILL_AT // PERSIST_EVERY * PERSIST_EVERY
TRACKER = "latest_checkpointed_iteration.txt"


class DemoError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(title: str, ckpt_dir: str, log: str, timeout: float, kill_at: int | None) -> tuple[int, str, float]:
    """pretrain_gpt.py under torchrun (2 ranks); echoes its progress; returns (exit code, output, seconds)."""
    print(f"\n== {title}", flush=True)
    for attempt in range(3):  # a free port can be taken by someone else before torchrun binds it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               SCRIPT, "--ckpt-dir", ckpt_dir, "--train-iters", str(TRAIN_ITERS),
               "--snapshot-interval", str(SNAPSHOT_EVERY), "--persist-interval", str(PERSIST_EVERY)]
        if kill_at is not None:
            cmd += ["--kill-at", str(kill_at)]
        if attempt == 0:
            shown = ["python", *(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd[1:])]
            print("   $ " + " ".join(shown), flush=True)
        rc, output, seconds = _run(cmd, log, timeout)
        if not (rc != 0 and "EADDRINUSE" in output and "[pretrain_gpt]" not in output):
            return rc, output, seconds
        print("   (the rendezvous port was taken meanwhile; retrying with another one)", flush=True)
    return rc, output, seconds


def _run(cmd: list[str], log: str, timeout: float) -> tuple[int, str, float]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    # Own session: on a timeout the whole torchrun tree goes at once (the saver has its own session).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env, cwd=REPO)
    timer = threading.Timer(timeout, _kill_group, (proc,))
    timer.start()
    lines = []
    try:
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                lines.append(line)
                _echo(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        _kill_group(proc)
        proc.stdout.close()
    seconds = time.monotonic() - started
    if seconds >= timeout:
        raise DemoError(f"still running after {timeout:.0f}s; killed it. Log: {log}")
    return rc, "".join(lines), seconds


def _echo(line: str) -> None:
    """Our script's lines, Megatron's own per-iteration log (shortened), and torchrun's verdict on each rank."""
    if (found := re.search(r"\[pretrain_gpt\] .*", line)) is not None:
        print("   " + found.group(0), flush=True)
    elif (found := re.search(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: (\S+)", line)) is not None:
        print(f"   megatron: iteration {found.group(1)}/{found.group(2)}, lm loss {float(found.group(3)):.6f}",
              flush=True)
    elif (found := re.search(r"exitcode\s*: (-?\d+) \(pid: \d+\)\s*\((\w+)\)", line)) is not None:
        print(f"   torchrun: a rank ended with exit code {found.group(1)} ({found.group(2)})", flush=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tracker(ckpt_dir: str) -> int | None:
    try:
        with open(os.path.join(ckpt_dir, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def job_slots(ckpt_dir: str) -> list[str]:
    """The shared-memory slots of the job of ``ckpt_dir`` (its ranks' snapshots)."""
    key = hashlib.sha1(os.path.abspath(ckpt_dir).encode()).hexdigest()[:12]
    shm_dir = os.environ.get("FLASHCKPT_SHM_DIR") or "/dev/shm"
    return sorted(glob.glob(os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{key}-r*")))


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run_demo(workdir: str, timeout: float, reference: bool) -> dict[str, float]:
    ckpt_dir, ref_dir = os.path.join(workdir, "ckpt"), os.path.join(workdir, "ckpt-reference")
    logs = {k: os.path.join(workdir, f"{k}.log") for k in ("crash", "relaunch", "reference")}
    timings = {}

    # 1. train, snapshot, persist; every rank dies right after the memory-only save of KILL_AT.
    rc, out, timings["crash"] = launch(
        f"1. training; every rank gets SIGKILL right after the memory-only save of iteration {KILL_AT}",
        ckpt_dir, logs["crash"], timeout, kill_at=KILL_AT)
    if f"SIGKILL after the save of iteration {KILL_AT}" not in out:
        raise DemoError(f"the run failed before iteration {KILL_AT} (exit code {rc}). Log: {logs['crash']}\n"
                        f"{_tail(out)}")
    if rc == 0:
        raise DemoError(f"the killed run exited with 0. Log: {logs['crash']}")
    print(f"   -> torchrun exited with code {rc}: the job was killed, as intended")
    if "Megatron's checkpoint worker is not started" not in out:
        raise DemoError(f"no note that the patch replaces Megatron's async worker. Log: {logs['crash']}")
    # The saver (its own process) outlives the job and finishes persisting iteration LAST_PERSISTED.
    if not wait_until(lambda: tracker(ckpt_dir) == LAST_PERSISTED, 60):
        raise DemoError(f"{ckpt_dir}/{TRACKER} says {tracker(ckpt_dir)} a minute after the kill; expected "
                        f"{LAST_PERSISTED}")
    slots = job_slots(ckpt_dir)
    if not slots:
        raise DemoError("the killed job left no shared-memory slots behind; something removed them")
    print(f"   -> newest iteration on disk: {tracker(ckpt_dir)} ({TRACKER}); iterations up to {KILL_AT} are in "
          f"{len(slots)} shared-memory slots in {os.path.dirname(slots[0])}")

    # 2. the same command again: Megatron's load_checkpoint must take KILL_AT from shared memory.
    rc, out, timings["relaunch"] = launch("2. relaunch of the same command", ckpt_dir, logs["relaunch"], timeout,
                                          kill_at=KILL_AT)
    found = re.search(r"\[pretrain_gpt\] resumed from iteration (\d+) \((\w+)\)", out)
    where = f"{found.group(2)} at iteration {found.group(1)}" if found else "nothing (it started from scratch)"
    if where != f"memory at iteration {KILL_AT}":
        raise DemoError(f"the relaunch resumed from {where}; expected memory at iteration {KILL_AT}. "
                        f"Log: {logs['relaunch']}\n{_tail(out)}")
    done = re.search(r"\[pretrain_gpt\] done: final iteration (\d+), lm loss (\S+);", out)
    if rc != 0 or done is None or int(done.group(1)) != TRAIN_ITERS:
        raise DemoError(f"the relaunch did not train to iteration {TRAIN_ITERS} (exit code {rc}). "
                        f"Log: {logs['relaunch']}\n{_tail(out)}")
    if tracker(ckpt_dir) != TRAIN_ITERS:
        raise DemoError(f"{TRACKER} says {tracker(ckpt_dir)} after the relaunch; expected {TRAIN_ITERS}")
    files = sorted(os.listdir(os.path.join(ckpt_dir, f"iter_{TRAIN_ITERS:07d}")))
    if "metadata.json" not in files or ".metadata" not in files:
        raise DemoError(f"iteration {TRAIN_ITERS} is not a torch_dist checkpoint: {files}")
    print(f"   -> iter_{TRAIN_ITERS:07d}/ holds Megatron's torch_dist files: {', '.join(files)}")
    print(f"   -> resumed from shared memory at iteration {KILL_AT} (the disk had only {LAST_PERSISTED}), trained "
          f"to {TRAIN_ITERS}, and iteration {TRAIN_ITERS} is committed on disk")

    # 3. optionally: the same training without the crash ends with the same loss.
    if reference:
        rc, ref, timings["reference"] = launch("3. reference: the same training, uninterrupted", ref_dir,
                                               logs["reference"], timeout, kill_at=None)
        ref_done = re.search(r"\[pretrain_gpt\] done: final iteration (\d+), lm loss (\S+);", ref)
        if rc != 0 or ref_done is None:
            raise DemoError(f"the reference run failed (exit code {rc}). Log: {logs['reference']}\n{_tail(ref)}")
        if ref_done.groups() != done.groups():
            raise DemoError(f"crashed+resumed run ended at {done.groups()}, the uninterrupted run at "
                            f"{ref_done.groups()} (iteration, loss)")
        print(f"   -> same final loss as the crashed+resumed run: {done.group(2)} at iteration {done.group(1)}")
        print("   (Megatron's logged lm loss of the second iteration of each launch is the mean of its first two:\n"
              "    training_log() does not reset its sums after a launch's first iteration. So the logs differ at\n"
              f"    iteration {KILL_AT + 2}; the training does not.)")

    # A normal end frees the shared memory; the saver exits on its own.
    dirs = [ckpt_dir, ref_dir] if reference else [ckpt_dir]
    if not wait_until(lambda: not any(job_slots(d) for d in dirs), 15):
        left = [s for d in dirs for s in job_slots(d)]
        for slot in left:
            os.unlink(slot)
        raise DemoError(f"shared-memory slots left behind after a normal end (removed them): {left}")
    return timings


def _tail(output: str, lines: int = 25) -> str:
    """The ranks' own error lines (torchrun prefixes them with [rankN]:), else the output's tail."""
    text = output.splitlines(keepends=True)
    errors = [line for line in text if line.startswith("[rank") and "]: " in line[:10]]
    return "".join(errors[-lines:] if errors else text[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="keep checkpoints and logs here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per torchrun launch")
    parser.add_argument("--reference", action="store_true",
                        help="also run the training uninterrupted and compare the final loss")
    args = parser.parse_args(argv)

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="flashckpt-megatron-demo-"))
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    try:
        timings = run_demo(workdir, args.timeout, args.reference)
    except DemoError as exc:
        print(f"\ndemo FAILED: {exc}\n(checkpoints and logs kept in {workdir})", flush=True)
        for slot in job_slots(os.path.join(workdir, "ckpt")) + job_slots(os.path.join(workdir, "ckpt-reference")):
            os.unlink(slot)  # the snapshots of a failed demo would otherwise stay in shared memory
        return 1
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items())
    print(f"\nwall time: {time.monotonic() - started:.1f}s ({parts})")
    print("demo OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
