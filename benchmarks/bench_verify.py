"""What verified memory restores cost: the save's blocking time, the helper thread's checksum time,
and a restore from memory into live tensors in a fresh process, each with and without checksums,
side by side in one run (order alternated), plus the raw speed of the candidate checksums.

"Without" is this package with the checksum step taken out in that process (the state of the
code before restores were verified): the trainer's checksum helper does not run, the restore copies
without checking. The restored step (3, memory only) is newer than a committed one (0), as after
a crash, so the restore checks each chunk as it copies it; with no commit at all it checks the
snapshot before copying (see the README).

    python benchmarks/bench_verify.py --gib 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CHILD = r"""
import json, os, sys, time, torch
torch.set_num_threads(1)
from flashckpt_integrations import Checkpointer
from flashckpt_integrations.core import verify, restore, loading

mode, phase, ckdir, job, gib = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
if mode == "unverified":  # the code before verification: no checksums taken, none checked
    verify.Checksummer.schedule = lambda self, slot, seq: None
    class _NoCheck:
        regions, files = 0, 0
        def check(self, indices=None): pass
        def blobs(self): return range(0)
        def fuse(self, pairs, base): return pairs, []
    loading.verify.open_check = lambda slot, header, meta: _NoCheck()
n = int(gib * (1 << 30) / 4 / 433)
state = {f"t{i}": torch.full((n,), float(i)) for i in range(433)}
ck = Checkpointer(ckdir, job_id=job)
out = {}
if phase == "save":
    ck.prepare(state)
    assert ck.save(0, state).wait(300).committed  # a commit: a failed check has a tier to restore over
    ck.load()  # warm: the slots and the checksum helper
    for step in (1, 2, 3):
        t = time.perf_counter(); ck.save(step, state, persist=False)
        out.setdefault("save", []).append(time.perf_counter() - t)
        t = time.perf_counter(); ck.sums.wait(); out.setdefault("sums", []).append(time.perf_counter() - t)
    print(json.dumps(out), flush=True)
    os._exit(0)  # the slots stay, as after a crash
live = {k: torch.zeros_like(v) for k, v in state.items()}  # live tensors are resident, as a model's are
t = time.perf_counter()
result = ck.load(target=live)
out["restore"] = time.perf_counter() - t
assert result.source == "memory" and result.step == 3, result
assert all(torch.equal(live[k], state[k]) for k in state)
print(json.dumps(out), flush=True)
ck.close()  # the job ends: its slots go
"""


def child(mode: str, phase: str, ckdir: str, job: str, gib: float) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, phase, ckdir, job, str(gib)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {phase} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checksum_speeds(mib: int = 256) -> dict[str, float]:
    data = memoryview(bytearray(os.urandom(1 << 20)) * mib)
    candidates = {"zlib.crc32": lambda d, v: zlib.crc32(d, v)}
    try:
        import crc32c

        candidates["crc32c (hardware CRC-32C)"] = lambda d, v: crc32c.crc32c(d, v)
    except ImportError:
        pass
    try:
        import xxhash

        candidates["xxhash xxh3_64"] = None
    except ImportError:
        xxhash = None
    speeds = {}
    for name, fn in candidates.items():
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            if fn is None:
                h = xxhash.xxh3_64()
                for i in range(0, len(data), 1 << 20):
                    h.update(data[i:i + (1 << 20)])
            else:
                value = 0
                for i in range(0, len(data), 1 << 20):
                    value = fn(data[i:i + (1 << 20)], value)
            best = min(best, time.perf_counter() - t)
        speeds[name] = best / (len(data) / 2**30)
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {m: {"save": [], "sums": [], "restore": []}
                                               for m in ("unverified", "verified")}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ("unverified", "verified") if repeat % 2 == 0 else ("verified", "unverified")
            for mode in order:
                job = f"bv-{uuid.uuid4().hex[:8]}"
                ckdir = os.path.join(tmp, job)
                saved = child(mode, "save", ckdir, job, args.gib)
                restored = child(mode, "restore", ckdir, job, args.gib)
                rows[mode]["save"].append(statistics.median(saved["save"]))
                rows[mode]["sums"].append(statistics.median(saved["sums"]))
                rows[mode]["restore"].append(restored["restore"])
    med = {m: {k: statistics.median(v) if v else 0.0 for k, v in r.items()} for m, r in rows.items()}
    print(f"state: {args.gib:g} GiB in 433 float32 tensors, one torch thread, {args.repeats} repeats, medians")
    print("| what | unverified (before) | verified | ratio |")
    print("|---|---|---|---|")
    print(f"| save, blocking (memory only, warm slot) | {med['unverified']['save']:.3f} s | "
          f"{med['verified']['save']:.3f} s | {med['verified']['save'] / med['unverified']['save']:.2f}x |")
    print(f"| checksums after the seal (helper thread) | - | {med['verified']['sums']:.3f} s | - |")
    print(f"| restore from memory into live tensors, fresh process | {med['unverified']['restore']:.3f} s | "
          f"{med['verified']['restore']:.3f} s | {med['verified']['restore'] / med['unverified']['restore']:.2f}x |")
    print()
    print("| checksum | seconds per GiB (one thread) |")
    print("|---|---|")
    for name, seconds in checksum_speeds().items():
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
