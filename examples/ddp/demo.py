"""Crash a 2-rank DDP job right after a memory-only snapshot, relaunch it, and check the result.

    python examples/ddp/demo.py

1. runs ``train.py`` under torchrun (2 ranks, gloo, CPU); rank 0 is SIGKILLed right after the
   memory-only save at step 14 (the newest checkpoint on disk is step 10);
2. relaunches the same command: it must resume from shared memory at step 14, not from disk;
3. runs the same training uninterrupted in another directory: the final parameters of both
   runs must be bit-identical;
4. prints how long a flash ``save`` held training, next to a plain ``torch.save`` of the same
   state to disk.

Prints "demo OK" at the end, or "demo FAILED" and exits non-zero.
"""

from __future__ import annotations

import argparse
import glob
import json
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
TRAIN = os.path.join(HERE, "train.py")

STEPS, SAVE_EVERY, PERSIST_EVERY, CRASH_AT = 20, 2, 10, 14


class DemoError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(name: str, ckpt_dir: str, out: str, log: str, *, crash_at: int | None, timeout: float,
           extra: list[str]) -> tuple[int, dict | None, float]:
    """Run train.py under torchrun with 2 ranks; echo rank 0's progress; return (rc, summary, seconds)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        TRAIN, "--ckpt-dir", ckpt_dir, "--out", out, "--steps", str(STEPS),
        "--save-every", str(SAVE_EVERY), "--persist-every", str(PERSIST_EVERY), "--compare-torch-save", *extra,
    ]
    if crash_at is not None:
        cmd += ["--crash-at-step", str(crash_at)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway; explicit = same in every run
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    print(f"\n== {name}", flush=True)
    started = time.monotonic()
    summary = None
    # Own session: on a timeout the whole torchrun tree (launcher and workers) goes at once.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env, cwd=REPO)
    timer = threading.Timer(timeout, _kill_group, (proc,))
    timer.start()
    try:
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                if line.startswith("[rank 0]"):
                    print("   " + line.rstrip(), flush=True)
                elif line.startswith("{") and '"final_step"' in line:
                    summary = json.loads(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        _kill_group(proc)  # nothing of this run may outlive it (the saver has its own session)
        proc.stdout.close()
    seconds = time.monotonic() - started
    if seconds >= timeout:
        raise DemoError(f"{name}: still running after {timeout:.0f}s; killed it. Log: {log}")
    return rc, summary, seconds


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def job_leftovers(ckpt_dir: str) -> tuple[list[int], list[str]]:
    """Saver processes and shared-memory slots that the job of ``ckpt_dir`` still has."""
    from flashckpt_integrations.core.client import job_id_for, job_key

    key = job_key(job_id_for(os.path.abspath(ckpt_dir)))  # named as its Checkpointer names it
    pids = []
    for cmdline_path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline_path, "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "flashckpt_integrations.core.saver" in argv and "--run-dir" in argv:
            run_dir = argv[argv.index("--run-dir") + 1] if argv.index("--run-dir") + 1 < len(argv) else ""
            if os.path.basename(run_dir).startswith(key + "-"):
                pids.append(int(cmdline_path.split("/")[2]))
    shm_dir = os.environ.get("FLASHCKPT_SHM_DIR") or "/dev/shm"
    slots = sorted(glob.glob(os.path.join(shm_dir, f"flashckpt-{os.getuid()}-{key}-r*")))
    return pids, slots


def wait_for_clean_end(ckpt_dirs: list[str], timeout: float = 15.0) -> list[str]:
    """Wait for the jobs' savers to exit on their own; return what is left (and end it)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [(d, *job_leftovers(d)) for d in ckpt_dirs]
        if not any(pids or slots for _, pids, slots in left) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems = []
    for ckpt_dir, pids, slots in left:
        for pid in pids:
            problems.append(f"saver pid {pid} of {ckpt_dir} still running after {timeout:.0f}s (killed it)")
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for slot in slots:
            problems.append(f"shared-memory slot {slot} left behind (removed it)")
            try:
                os.unlink(slot)
            except FileNotFoundError:
                pass
    return problems


def same_parameters(path_a: str, path_b: str) -> tuple[bool, str]:
    import torch

    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    if list(a) != list(b):
        return False, f"different keys: {list(a)} vs {list(b)}"
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    if differing:
        worst = max(float((a[k] - b[k]).abs().max()) for k in differing)
        return False, f"{len(differing)}/{len(a)} tensors differ (max abs diff {worst:.3g}): {differing}"
    return True, f"{len(a)} tensors, {sum(t.numel() for t in a.values()):,} values, all bit-identical"


def job_dirs(workdir: str) -> tuple[str, str]:
    """Checkpoint directories of the crashed/resumed job and of the reference job."""
    return os.path.join(workdir, "ckpt-crash"), os.path.join(workdir, "ckpt-reference")


def run_demo(workdir: str, timeout: float, extra: list[str]) -> dict:
    crash_dir, ref_dir = job_dirs(workdir)
    resumed_out, ref_out = os.path.join(workdir, "resumed.pt"), os.path.join(workdir, "reference.pt")
    logs = {k: os.path.join(workdir, f"{k}.log") for k in ("crash", "relaunch", "reference")}
    timings = {}

    # 1. the job dies right after the memory-only snapshot of CRASH_AT.
    rc, _, timings["crash"] = launch(
        f"1. training, rank 0 gets SIGKILL after the memory-only save at step {CRASH_AT}", crash_dir, resumed_out,
        logs["crash"], crash_at=CRASH_AT, timeout=timeout, extra=extra)
    if rc == 0:
        raise DemoError(f"the crashing run exited with 0; it should have been killed. Log: {logs['crash']}")
    with open(logs["crash"]) as f:
        if f"SIGKILL after the save at step {CRASH_AT}" not in f.read():
            raise DemoError(f"the run failed before reaching step {CRASH_AT} (exit code {rc}). Log: {logs['crash']}\n"
                            f"{_tail(logs['crash'])}")
    print(f"   -> torchrun exited with code {rc}: the job was killed, as intended "
          f"(newest checkpoint on disk: step {CRASH_AT // PERSIST_EVERY * PERSIST_EVERY})")
    slots = job_leftovers(crash_dir)[1]
    if not slots:
        raise DemoError("the killed job left no shared-memory slots behind; something removed them")
    print(f"   -> its snapshots outlive it in shared memory: {len(slots)} slots in {os.path.dirname(slots[0])}")

    # 2. the same command again: it must resume from shared memory at CRASH_AT.
    rc, resumed, timings["relaunch"] = launch(
        "2. relaunch of the same command", crash_dir, resumed_out, logs["relaunch"], crash_at=CRASH_AT,
        timeout=timeout, extra=extra)
    with open(logs["relaunch"]) as f:
        found = re.search(r"resumed from step (\d+) \((\w+)\)", f.read())
    where = f"{found.group(2)} at step {found.group(1)}" if found else "nothing (it started from scratch)"
    if where != f"memory at step {CRASH_AT}":
        raise DemoError(f"the relaunch resumed from {where}; expected memory at step {CRASH_AT} (were the slots "
                        f"removed in between, e.g. by another program cleaning {os.path.dirname(slots[0])}?). "
                        f"Log: {logs['relaunch']}")
    if rc != 0 or resumed is None:
        raise DemoError(f"the relaunch failed (exit code {rc}). Log: {logs['relaunch']}\n{_tail(logs['relaunch'])}")
    assert resumed["source"] == "memory" and resumed["resumed_from_step"] == CRASH_AT, resumed
    print(f"   -> resumed from shared memory at step {CRASH_AT} in {resumed['load_ms']:.0f} ms")

    # 3. the same training without a crash.
    rc, reference, timings["reference"] = launch(
        "3. reference: the same training, uninterrupted", ref_dir, ref_out, logs["reference"], crash_at=None,
        timeout=timeout, extra=extra)
    if rc != 0 or reference is None:
        raise DemoError(f"the reference run failed (exit code {rc}). Log: {logs['reference']}\n"
                        f"{_tail(logs['reference'])}")
    equal, detail = same_parameters(resumed_out, ref_out)
    if not equal:
        raise DemoError(f"final parameters of the resumed run differ from the uninterrupted run: {detail}")
    print(f"   -> final parameters of the crashed+resumed run == uninterrupted run: {detail}")

    problems = wait_for_clean_end([crash_dir, ref_dir])
    if problems:
        raise DemoError("the jobs did not end cleanly:\n  " + "\n  ".join(problems))

    _print_stall_table(reference)
    return {"resumed": resumed, "reference": reference, "timings": timings, "resumed_out": resumed_out,
            "reference_out": ref_out}


def _print_stall_table(summary: dict) -> None:
    flash, plain = summary["save_ms_mean"], summary["torch_save_ms_mean"]
    print(f"\nTraining stall per checkpoint, rank 0 of the uninterrupted run "
          f"({summary['params'] / 1e6:.1f}M parameters, {summary['state_mb']:.0f} MiB of model + AdamW state "
          f"per rank):")
    print(f"   {'method':<38} {'mean ms':>8} {'median ms':>10} {'saves':>6}")
    print(f"   {'flashckpt save (snapshot to memory)':<38} {flash:>8.1f} {summary['save_ms_median']:>10.1f} "
          f"{summary['saves']:>6}")
    if plain is not None:
        print(f"   {'torch.save to disk (page cache)':<38} {plain:>8.1f} {summary['torch_save_ms_median']:>10.1f} "
              f"{summary['torch_saves']:>6}")
        print(f"   -> flash save blocks {plain / flash:.1f}x less (mean); steps {summary['committed_steps']} "
              "were written to disk (with fsync) by the background saver")


def _tail(path: str, lines: int = 30) -> str:
    """The ranks' own error lines (torchrun prefixes them with [rankN]:), else the log's tail."""
    with open(path) as f:
        text = f.readlines()
    errors = [line for line in text if (line.startswith("[rank") and "]: " in line[:10]) or ": error: " in line]
    return "".join(errors[-lines:] if errors else text[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flashckpt DDP crash/resume demo")
    parser.add_argument("--workdir", help="keep checkpoints, logs and final parameters here (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per torchrun launch")
    parser.add_argument("--summary-json", help="write the runs' JSON summaries here")
    parser.add_argument("train_args", nargs="*", help="extra train.py arguments, after --, e.g. -- --hidden 2048")
    args = parser.parse_args(argv)

    workdir = args.workdir or tempfile.mkdtemp(prefix="flashckpt-ddp-demo-")
    os.makedirs(workdir, exist_ok=True)
    started = time.monotonic()
    try:
        result = run_demo(workdir, args.timeout, args.train_args)
    except DemoError as exc:
        print(f"\ndemo FAILED: {exc}\n(checkpoints and logs kept in {workdir})", flush=True)
        for problem in wait_for_clean_end(list(job_dirs(workdir)), timeout=5.0):
            print(f"cleanup: {problem}")
        return 1
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - started
    t = result["timings"]
    print(f"\nwall time: {total:.1f}s (crash run {t['crash']:.1f}s, relaunch {t['relaunch']:.1f}s, "
          f"reference {t['reference']:.1f}s)")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({**result, "total_s": total}, f, indent=1)
    print("demo OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
