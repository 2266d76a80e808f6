"""``flashckpt``: look at checkpoints on storage and in shared memory, and clean up.

    flashckpt ls DIR               committed steps on storage, and steps held in memory per rank
    flashckpt inspect DIR STEP     one committed step: ranks, files, sizes, checksums
    flashckpt clean DIR            remove this host's shared memory of the job that saves to DIR
    flashckpt persist DIR          persist and commit the newest step this host's ranks hold in memory
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import threading
import time
from typing import IO, Any

from . import knobs
from .core.client import job_id_for, job_key, saver_running, user_run_root
from .core.layout import Layout, commit_record, committed_steps, failure_record, marked_steps, read_json
from .core.rescue import RescueStatus, job_slots, persist_newest
from .core.shm_buffer import Slot
from .core.storage import storage_from_url
from .errors import FlashCkptError


def _url(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _slots(url: str, job_id: str | None, shm_dir: str | None) -> list[tuple[int, str]]:
    """This host's slots of the job, named as its Checkpointer names them (``job_id``, else
    ``$FLASHCKPT_JOB_ID``, else ``url``; ``shm_dir``, else ``$FLASHCKPT_SHM_DIR``, else /dev/shm)."""
    return sorted((rank, path) for rank, paths in job_slots(url, job_id, shm_dir).items() for path in paths)


def _memory(url: str, job_id: str | None, shm_dir: str | None) -> list[dict[str, Any]]:
    rows = []
    for rank, path in _slots(url, job_id, shm_dir):
        slot = Slot.attach(path)
        header = slot.read_header() if slot is not None else None
        rows.append({
            "rank": rank, "slot": os.path.basename(path), "bytes": os.path.getsize(path),
            "state": header.state.name.lower() if header else "empty", "step": header.step if header else None,
        })
        if slot is not None:
            slot.close()
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    storage = storage_from_url(url)
    committed = committed_steps(storage)
    in_flight = [s for s in marked_steps(storage) if s not in committed and failure_record(storage, s) is None]
    memory = _memory(url, args.job_id, args.shm_dir)
    if args.json:
        print(json.dumps({"committed": committed, "uncommitted": in_flight, "memory": memory}, indent=1))
        return 0
    print(f"{url}")
    print(f"  committed steps: {', '.join(map(str, committed)) or '-'}")
    if in_flight:
        print(f"  not committed:   {', '.join(map(str, in_flight))}")
    for row in memory:
        step = row["step"] if row["state"] == "complete" else "-"
        print(f"  memory rank {row['rank']:>4}  {row['slot']}  {row['bytes'] / 2**20:10.1f} MiB  "
              f"{row['state']:>8}  step {step}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    storage = storage_from_url(url)
    record = commit_record(storage, args.step)
    if record is None:
        failure = failure_record(storage, args.step)
        why = f": {failure['reason']}" if failure else ""
        print(f"step {args.step} is not committed in {url}{why}", file=sys.stderr)
        return 1
    layout = Layout()
    ranks = []
    for rank in range(record["world_size"]):
        marker = read_json(storage, layout.rank_marker(args.step, rank, sid=record.get("sid", "")))
        ranks.append({"rank": rank, "files": marker["files"]})
    if args.json:
        print(json.dumps({"commit": record, "ranks": ranks}, indent=1))
        return 0
    total = sum(f["size"] for r in ranks for f in r["files"])
    print(f"step {args.step}: {record['world_size']} ranks, {total / 2**20:.1f} MiB in {record['step_dir']}/")
    for row in ranks:
        for entry in row["files"]:
            print(f"  rank {row['rank']:>4}  {entry['path']:<40} {entry['size']:>14,d} B  "
                  f"crc32 {entry['crc32']:08x}  {entry['codec']}")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    removed = 0
    for _, path in _slots(url, args.job_id, args.shm_dir):
        os.unlink(path)
        removed += 1
    run_dirs = glob.glob(os.path.join(user_run_root(), f"{job_key(job_id_for(url, args.job_id))}-*"))
    live = [d for d in run_dirs if saver_running(d)]
    for run_dir in run_dirs:
        if run_dir not in live:  # a finished job's socket, locks, slot records and saver log
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"removed {removed} shared-memory slot(s) and {len(run_dirs) - len(live)} saver run "
          f"directory(ies) of the job saving to {url}")
    for run_dir in live:
        print(f"kept {run_dir}: its saver is still running", file=sys.stderr)
    return 0


def cmd_persist(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    slots = job_slots(url, args.job_id, args.shm_dir)
    if not slots:
        job_id = job_id_for(None, args.job_id)
        print(f"no shared memory of the job saving to {url} on this host (looked in "
              f"{args.shm_dir or knobs.get(knobs.SHM_DIR, '/dev/shm')}{', job id ' + job_id if job_id else ''}); "
              "nothing to persist", file=sys.stderr)
        return 1
    bar = _ProgressBar(sys.stderr)
    try:
        result = persist_newest(slots, progress=bar, commit_timeout=args.commit_timeout)
    finally:
        bar.finish()
    if args.json:
        print(json.dumps({"status": result.status.value, "step": result.step, "ranks": result.ranks,
                          "bytes_written": result.bytes_written, "reason": result.reason}, indent=1))
    else:
        print(f"{result.status.value}: {result.reason}" + (
            f"; {result.bytes_written / 2**20:.1f} MiB written" if result.bytes_written else ""))
    return 1 if result.status is RescueStatus.FAILED else 0


class _ProgressBar:
    """``persisting [#####-----]  50%  12.0/24.0 MiB`` on one line of ``stream``, redrawn at most
    ten times a second (called from the writing threads)."""

    WIDTH = 30

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.drawn = False
        self.last = 0.0
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.last < 0.1 and done < total:
                return
            self.last = now
            filled = self.WIDTH * done // total if total else self.WIDTH
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\rpersisting [{bar}] {done / max(total, 1):4.0%}  "
                              f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB")
            self.stream.flush()
            self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shm-dir", default=None,
                        help=f"where the job's slots are (default: ${knobs.SHM_DIR}, else /dev/shm)")
    parser.add_argument("--job-id", default=None,
                        help=f"the job id, when the job set one in its config (default: ${knobs.JOB_ID}, else DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="committed steps and in-memory snapshots")
    ls.add_argument("dir")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)
    inspect = sub.add_parser("inspect", help="files, sizes and checksums of a committed step")
    inspect.add_argument("dir")
    inspect.add_argument("step", type=int)
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_inspect)
    clean = sub.add_parser("clean", help="remove this host's shared memory of a job")
    clean.add_argument("dir")
    clean.set_defaults(func=cmd_clean)
    persist = sub.add_parser("persist", help="persist and commit the newest step held in this host's memory")
    persist.add_argument("dir")
    persist.add_argument("--commit-timeout", type=float, default=None,
                         help="seconds to wait for other nodes' ranks (default: the job's commit timeout)")
    persist.add_argument("--json", action="store_true")
    persist.set_defaults(func=cmd_persist)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except FlashCkptError as exc:
        print(f"flashckpt: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
