"""``flashckpt``: look at checkpoints on storage and in shared memory, and clean up.

    flashckpt ls DIR               committed steps on storage, steps held in memory per rank (local or
                                   replica, on every node when the job replicates), the saver
    flashckpt inspect DIR STEP     one committed step: ranks, files, sizes, checksums
    flashckpt clean DIR            remove this host's shared memory of the job that saves to DIR
    flashckpt persist DIR          persist and commit the newest step this host's ranks hold in memory

The help texts are plain text (``_DESCRIPTION``, ``_EPILOG``, the options' help); exit status 0
means done, 1 a negative answer or a failed persist, 2 bad usage or an unusable DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import sys
import textwrap
import threading
import time
from typing import IO, Any

from . import knobs
from ._utils.help import HelpFormatter
from .core import replication, reshard, verify
from .core.client import job_id_for, job_key, saver_running, user_run_root
from .core.layout import (
    Layout,
    commit_record,
    committed_steps,
    failure_record,
    file_mismatch,
    marked_steps,
    read_json,
)
from .core.protocol import LOG_NAME
from .core.replication import list_replicas, peers, replica_paths
from .core.rescue import RescueStatus, job_replicas, job_slots, persist_newest
from .core.shm_buffer import Slot
from .core.storage import ENTRY_POINT_GROUP, Storage, storage_from_url
from .errors import FlashCkptError

DIST_NAME = "flashckpt-integrations"

EXIT_OK = 0
EXIT_NO = 1
"""The command ran and the answer is no (a step that is not committed), or persisting failed."""
EXIT_USAGE = 2
"""Bad arguments, a DIR that does not exist or whose storage cannot be opened, or another error."""

_DESCRIPTION = "Look at flash checkpoints on storage and in this host's shared memory, and clean up."

_EPILOG = f"""\
DIR is the directory (or storage URL) that the job's checkpointer saves to:
  Checkpointer, DCP, FSDP  the directory given to Checkpointer(...)
  HF Trainer               TrainingArguments.output_dir (it holds checkpoint-<N>/)
  accelerate               ProjectConfiguration.project_dir with automatic_checkpoint_naming
                           (it holds checkpoints/checkpoint_<N>/), else the checkpoint_dir
                           given to enable()
  DeepSpeed                the directory given to enable() and engine.save_checkpoint()
                           (it holds global_step<N>/ and latest)
  Megatron-LM and -Core    the --save directory (it holds iter_XXXXXXX/)
  flashckpt-run            the directory given as --checkpoint-dir

The job is named by --job-id, else ${knobs.JOB_ID}, else DIR; its shared memory is
looked for in --shm-dir, else ${knobs.SHM_DIR}, else /dev/shm. Both options go before
or after the command.

exit status:
  {EXIT_OK}  done
  {EXIT_NO}  the answer is no: inspect: the step is not committed; persist: this host holds
     no memory of the job, or persisting failed
  {EXIT_USAGE}  bad usage: wrong arguments, DIR does not exist (or is not a directory), no
     storage backend for DIR's URL scheme, or another error reading the checkpoint
"""


class _CommandError(Exception):
    """A one-line error for the user, with the exit status to return."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def _url(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


# --- storage ------------------------------------------------------------------------------------


def _open_storage(url: str) -> Storage:
    """The storage of ``url``, or a :class:`_CommandError` that says what to do."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("", "file") and not _has_entry_point(scheme) and not _fsspec_knows(scheme):
        fsspec = "fsspec does not know it" if importlib.util.find_spec("fsspec") else "fsspec is not installed"
        raise _CommandError(
            f"no storage backend for {url}: nothing is registered for the scheme '{scheme}' in the "
            f"'{ENTRY_POINT_GROUP}' entry-point group, and {fsspec}. Publish a storage factory for '{scheme}' "
            f"in that entry-point group (the saver finds it there too), or install the fsspec backend "
            f"that provides '{scheme}://'")
    try:
        return storage_from_url(url)
    except FlashCkptError as exc:
        raise _CommandError(f"cannot open the storage of {url}: {exc}") from exc
    except (ValueError, ImportError, OSError) as exc:
        raise _CommandError(f"cannot open the storage of {url}: {type(exc).__name__}: {exc}") from exc


def _has_entry_point(scheme: str) -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == scheme for ep in entry_points(group=ENTRY_POINT_GROUP))


def _fsspec_knows(scheme: str) -> bool:
    if importlib.util.find_spec("fsspec") is None:
        return False
    import fsspec

    return scheme in fsspec.available_protocols()


def _require_dir(storage: Storage, url: str, args: argparse.Namespace) -> None:
    """Refuse a checkpoint directory that does not exist (with a hint when memory of its job is left)."""
    if "://" not in url and os.path.exists(url) and not os.path.isdir(url):
        raise _CommandError(f"{url} is not a directory")
    if storage.exists(""):
        return
    message = f"{url} does not exist"
    slots = _slots(url, args.job_id, args.shm_dir)
    if slots:
        message += (f"; this host still holds {len(slots)} shared-memory slot(s) of the job that saved to it: "
                    f"remove them with 'flashckpt clean {url}'")
    raise _CommandError(message)


# --- shared memory and the saver ------------------------------------------------------------------


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


def _restorable(url: str, job_id: str | None, shm_dir: str | None) -> list[dict[str, Any]]:
    """Newest first: each step in this host's memory (slots and replicas), the size of the job that
    saved it, and which of its ranks are held here. A step held for every rank restores here onto
    that many ranks, and through the DCP adapter onto any other number (``core.reshard``)."""
    shm = shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm")
    held: dict[tuple[int, int], set[int]] = {}
    for snap in reshard.held_snapshots(url, job_id, shm):
        held.setdefault((snap.step, snap.world_size), set()).add(snap.rank)
    return [{"step": step, "world_size": world, "ranks": sorted(ranks), "missing": sorted(set(range(world)) - ranks)}
            for (step, world), ranks in sorted(held.items(), key=lambda item: (-item[0][0], item[0][1]))]


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _run_dirs(url: str, job_id: str | None) -> list[str]:
    """This host's saver run directories of the job (one per node id: socket, locks, log)."""
    return sorted(glob.glob(os.path.join(user_run_root(), f"{job_key(job_id_for(url, job_id))}-*")))


def _savers(url: str, job_id: str | None) -> list[dict[str, Any]]:
    return [{"run_dir": run_dir, "log": os.path.join(run_dir, LOG_NAME), "running": saver_running(run_dir)}
            for run_dir in _run_dirs(url, job_id)]


def _replicas(url: str, job_id: str | None, shm_dir: str | None) -> list[dict[str, Any]]:
    """The replica slots of the job in this host's shared memory (copies of other nodes' ranks)."""
    shm = shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm")
    return [r.to_dict() for r in list_replicas(shm, job_key(job_id_for(url, job_id)))]


def _nodes(storage: Storage, url: str, job_id: str | None) -> list[dict[str, Any]]:
    """What each node's saver holds, local or replica, asked over the job's authenticated connections
    (empty when the job does not replicate)."""
    job = job_key(job_id_for(url, job_id))
    if not storage.list(f"{peers.PEERS_DIR}/{job}"):
        return []
    try:
        secret = peers.job_secret(storage, create=False)
    except FlashCkptError as exc:
        return [{"node_rank": None, "state": "refused", "error": str(exc), "local": [], "replicas": []}]
    if secret is None:
        return []
    return replication.survey(peers.PeerDialer(storage, job, secret))


def _replication_status(run_dirs: list[str]) -> list[dict[str, Any]]:
    found = []
    for run_dir in run_dirs:
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(run_dir, replication.STATUS_FILE)) as f:
                found.append({"run_dir": run_dir, **json.load(f)})
    return found


def _print_nodes(nodes: list[dict[str, Any]], status: list[dict[str, Any]]) -> None:
    for node in nodes:
        where = (node.get("record") or {}).get("host", "?"), (node.get("record") or {}).get("port", "?")
        state = node["state"] if node["state"] == "ok" else f"{node['state']}: {node.get('error')}"
        print(f"  node {node['node_rank']}  {where[0]}:{where[1]}  {state}")
        for kind in ("local", "replicas"):
            by_rank: dict[int, list[dict[str, Any]]] = {}
            for entry in node[kind]:
                by_rank.setdefault(entry["rank"], []).append(entry)
            for rank in sorted(by_rank):
                steps = ", ".join(str(e["step"]) for e in sorted(by_rank[rank], key=lambda e: e["step"]))
                origin = {e.get("from_node") for e in by_rank[rank]} - {None}
                tail = f"  (from node {', '.join(map(str, sorted(origin)))})" if origin else ""
                print(f"    {'local' if kind == 'local' else 'replica':<7} rank {rank:>4}  steps {steps}{tail}")
    for saver in status:
        kept = saver.get("kept")
        if kept and saver.get("node_rank") == 0:
            rounds = saver.get("rounds") or {}
            print(f"  kept in memory on every node: step {kept['step']} ({time.time() - kept['time']:.0f} s ago; "
                  f"rounds kept {rounds.get('kept', 0)}, not kept {rounds.get('not_kept', 0)})")
        for rank, sent in sorted(saver.get("sent", {}).items(), key=lambda item: int(item[0])):
            for node, outcome in sorted(sent.items()):
                told = "ok" if outcome.get("ok") else f"failed: {outcome.get('reason')}"
                print(f"  copy of rank {rank:>4} step {outcome['step']} to node {node}: {told}")


# --- commands -----------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    storage = _open_storage(url)
    _require_dir(storage, url, args)
    committed = committed_steps(storage)
    in_flight = [s for s in marked_steps(storage) if s not in committed and failure_record(storage, s) is None]
    memory = _memory(url, args.job_id, args.shm_dir)
    savers = _savers(url, args.job_id)
    replicas, nodes = _replicas(url, args.job_id, args.shm_dir), _nodes(storage, url, args.job_id)
    status = _replication_status([s["run_dir"] for s in savers])
    restorable = _restorable(url, args.job_id, args.shm_dir)
    if args.json:
        print(json.dumps({"dir": url, "committed": committed, "uncommitted": in_flight, "memory": memory,
                          "savers": savers, "replicas": replicas, "nodes": nodes, "replication": status,
                          "restorable": restorable}, indent=1))
        return EXIT_OK
    print(f"{url}")
    print(f"  committed steps: {', '.join(map(str, committed)) or '-'}")
    if in_flight:
        print(f"  not committed:   {', '.join(map(str, in_flight))}")
    for row in memory:
        step = row["step"] if row["state"] == "complete" else "-"
        print(f"  memory rank {row['rank']:>4}  {row['slot']}  {_format_size(row['bytes']):>10}  "
              f"{row['state']:>8}  step {step}")
    for row in replicas:
        print(f"  replica rank {row['rank']:>3}  step {row['step']}  {_format_size(row['bytes']):>10}  "
              f"from node {row['from_node']}")
    if not memory and not replicas:
        print("  memory:          none on this host")
    if restorable:
        print("  steps in this host's memory, by the job that saved them (local slots and replicas):")
    for row in restorable:
        held = "every rank" if not row["missing"] else \
            f"ranks {_ranks_text(row['ranks'])}, not {_ranks_text(row['missing'])}"
        print(f"    step {row['step']:<6} saved by {row['world_size']} ranks: {held}")
    if nodes:
        print("  nodes (what each node's saver holds for which ranks):")
    _print_nodes(nodes, status)
    for saver in savers:
        log = saver["log"] if os.path.exists(saver["log"]) else f"{saver['log']} (not written)"
        print(f"  saver:           {'running' if saver['running'] else 'not running'}")
        print(f"    run dir:       {saver['run_dir']}")
        print(f"    log:           {log}")
    if not savers:
        print(f"  saver:           none on this host (no run directory of the job in {user_run_root()})")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    storage = _open_storage(url)
    _require_dir(storage, url, args)
    record = commit_record(storage, args.step)
    if record is None:
        failure = failure_record(storage, args.step)
        why = f": {failure['reason']}" if failure else ""
        raise _CommandError(f"step {args.step} is not committed in {url}{why}", EXIT_NO)
    layout = Layout()
    ranks = []
    for rank in range(record["world_size"]):
        marker = read_json(storage, layout.rank_marker(args.step, rank, sid=record.get("sid", "")))
        ranks.append({"rank": rank, "files": marker["files"]})
    if args.json:
        print(json.dumps({"commit": record, "ranks": ranks}, indent=1))
        return EXIT_OK
    total = sum(f["size"] for r in ranks for f in r["files"])
    print(f"step {args.step}: {record['world_size']} ranks, {_format_size(total)} in {record['step_dir']}/")
    for row in ranks:
        for entry in row["files"]:
            print(f"  rank {row['rank']:>4}  {entry['path']:<40} {entry['size']:>14,d} B  "
                  f"crc32 {entry['crc32']:08x}  {entry['codec']}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    storage = _open_storage(url)
    _require_dir(storage, url, args)
    shm = args.shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm")
    rows = [{"what": "memory", "rank": rank, "where": os.path.basename(path), **verify.check_slot(path)}
            for rank, path in _slots(url, args.job_id, args.shm_dir)]
    rows += [{"what": "replica", "rank": rank, "where": os.path.basename(path), **verify.check_slot(path)}
             for rank, paths in sorted(replica_paths(shm, job_key(job_id_for(url, args.job_id))).items())
             for path in paths]
    rows += [row for step in committed_steps(storage) for row in _verify_commit(storage, step)]
    rows = [r for r in rows if r["status"] != "empty"]
    bad = [r for r in rows if r["status"] != "ok"]
    if args.json:
        print(json.dumps({"dir": url, "checked": rows, "problems": len(bad)}, indent=1))
    else:
        print(url)
        for row in rows:
            print(f"  {row['what']:<8} rank {row['rank']:>4}  step {row['step']!s:>8}  {row['status']:<10}  "
                  f"{row['where']}")
            if row["detail"]:
                print(f"      {row['detail']}")
        print(f"  {len(rows) - len(bad)} good, {len(bad)} not" + ("" if bad else ": every copy verifies"))
    return EXIT_NO if bad else EXIT_OK


def _verify_commit(storage: Storage, step: int) -> list[dict[str, Any]]:
    """Every rank's files of committed ``step`` read back against the sizes and crc32s of its marker."""
    record, layout, rows = commit_record(storage, step), Layout(), []
    for rank in range(record["world_size"]):
        status, detail, where = "ok", None, f"{record['step_dir']}/"
        try:
            marker = read_json(storage, layout.rank_marker(step, rank, sid=record.get("sid", "")))
            for entry in marker["files"]:
                path = f"{record['step_dir']}/{entry['path']}"
                detail = file_mismatch(path, storage.read(path), entry)
                if detail is not None:
                    status = "bad"
                    break
        except (OSError, FlashCkptError, ValueError, KeyError) as exc:
            status, detail = "bad", f"{type(exc).__name__}: {exc}"
        rows.append({"what": "storage", "rank": rank, "step": step, "where": where, "status": status,
                     "detail": detail})
    return rows


def cmd_clean(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    removed = 0
    shm = args.shm_dir or knobs.get(knobs.SHM_DIR, "/dev/shm")
    replica_files = [p for paths in replica_paths(shm, job_key(job_id_for(url, args.job_id))).values() for p in paths]
    for path in [path for _, path in _slots(url, args.job_id, args.shm_dir)] + replica_files:
        os.unlink(path)
        removed += 1
    run_dirs = _run_dirs(url, args.job_id)
    live = [d for d in run_dirs if saver_running(d)]
    for run_dir in run_dirs:
        if run_dir not in live:  # a finished job's socket, locks, slot records and saver log
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"removed {removed} shared-memory slot(s) and {len(run_dirs) - len(live)} saver run "
          f"directory(ies) of the job saving to {url}")
    for run_dir in live:
        print(f"kept {run_dir}: its saver is still running", file=sys.stderr)
    return EXIT_OK


def cmd_persist(args: argparse.Namespace) -> int:
    url = _url(args.dir)
    slots = job_slots(url, args.job_id, args.shm_dir)
    replicas = job_replicas(url, args.job_id, args.shm_dir) if args.from_replicas else {}
    if not slots and not replicas:
        job_id = job_id_for(None, args.job_id)
        raise _CommandError(
            f"no shared memory of the job saving to {url} on this host (looked in "
            f"{args.shm_dir or knobs.get(knobs.SHM_DIR, '/dev/shm')}{', job id ' + job_id if job_id else ''}); "
            "nothing to persist", EXIT_NO)
    bar = _ProgressBar(sys.stderr)
    result = None
    try:
        result = persist_newest(slots, replicas=replicas, progress=bar, commit_timeout=args.commit_timeout)
    finally:
        bar.finish(complete=result is not None and result.status is not RescueStatus.FAILED)
    if args.json:
        print(json.dumps({"status": result.status.value, "step": result.step, "ranks": result.ranks,
                          "bytes_written": result.bytes_written, "reason": result.reason}, indent=1))
    else:
        print(f"{result.status.value}: {result.reason}" + (
            f"; {_format_size(result.bytes_written)} written" if result.bytes_written else ""))
    return EXIT_NO if result.status is RescueStatus.FAILED else EXIT_OK


# --- output -------------------------------------------------------------------------------------


def _format_size(nbytes: float) -> str:
    """``512 B``, ``4.0 KiB``, ``1.5 MiB``, ``2.0 GiB``, ``1.1 TiB``."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    value, index = nbytes / 1024, 0
    while value >= 1024 and index < len(units) - 1:
        value, index = value / 1024, index + 1
    return f"{value:.1f} {units[index]}"


class _ProgressBar:
    """``persisting [#####-----]  50%  12.0 MiB/24.0 MiB`` on one line of ``stream``.

    Called from the writing threads with (bytes written, bytes expected). It redraws only when the
    line it would show changes, at most ten times a second, and never at 100% while writing:
    :meth:`finish` draws the final line once (100% when the persist succeeded) and ends the line.
    """

    WIDTH = 30
    INTERVAL = 0.1

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.drawn = ""
        self.done = self.total = 0
        self.last = float("-inf")
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.done, self.total = done, max(total, done)
            if done >= total:  # the final line is finish()'s
                return
            line = self.render(done, total)
            now = time.monotonic()
            if line == self.drawn or now - self.last < self.INTERVAL:
                return
            self._draw(line)
            self.last = now

    def finish(self, complete: bool = True) -> None:
        with self.lock:
            if complete and self.done:
                self._draw(self.render(self.done, self.done))
            if self.drawn:
                self.stream.write("\n")
                self.stream.flush()

    def render(self, done: int, total: int) -> str:
        filled = self.WIDTH * done // total if total else self.WIDTH
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        return (f"persisting [{bar}] {done / total if total else 1:4.0%}  "
                f"{_format_size(done)}/{_format_size(total)}")

    def _draw(self, line: str) -> None:
        pad = " " * max(0, len(self.drawn) - len(line))  # a shorter line covers the longer one
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()
        self.drawn = line


# --- arguments ----------------------------------------------------------------------------------


def package_version(dist: str = DIST_NAME) -> str:
    """The installed distribution's version, else the package's own ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _add_job_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """``--shm-dir``/``--job-id``, taken before the command (``default`` None) and after it
    (``default`` SUPPRESS, so that a value given before the command stays)."""
    parser.add_argument("--shm-dir", default=default, metavar="DIR",
                        help=f"where the job's shared-memory slots are (default: ${knobs.SHM_DIR}, else /dev/shm)")
    parser.add_argument("--job-id", default=default, metavar="ID",
                        help="the job id, when the job set one in CheckpointerConfig.job_id "
                        f"(default: ${knobs.JOB_ID}, else DIR)")


def _command(sub: Any, name: str, func: Any, help_text: str, description: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=textwrap.fill(description, 88), epilog=_EPILOG,
                            formatter_class=HelpFormatter)
    parser.add_argument("dir", metavar="DIR", help="the job's checkpoint directory or storage URL (see below)")
    _add_job_options(parser, argparse.SUPPRESS)
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashckpt", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the version and exit")
    _add_job_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    json_help = "print JSON instead of text"
    ls = _command(sub, "ls", cmd_ls, "committed steps, in-memory snapshots and the saver",
                  "List the committed (and not yet committed) steps in DIR, the steps each rank of this host "
                  "holds in shared memory, the replicas of other nodes' ranks this host holds, and the job's saver "
                  "on this host: run directory, log, running or not. For a job with replicas on, also what each "
                  "node's saver holds for which ranks, local or replica (asked over the job's authenticated "
                  "connections), and how each node's newest copies went.")
    ls.add_argument("--json", action="store_true", help=json_help)
    inspect = _command(sub, "inspect", cmd_inspect, "files, sizes and checksums of a committed step",
                       "Show the ranks, files, sizes and CRC32 checksums of one committed step.")
    inspect.add_argument("step", type=int, metavar="STEP", help="the step number")
    inspect.add_argument("--json", action="store_true", help=json_help)
    verify_cmd = _command(sub, "verify", cmd_verify, "check every copy of the job against its checksums",
                          "Read every shared-memory snapshot and peer replica of the job on this host, and every "
                          "file of every committed step in DIR, and check each against the checksum taken when it "
                          "was saved. Prints what is good and what is not (bad, unverified, torn); exits 1 when "
                          "anything is not good.")
    verify_cmd.add_argument("--json", action="store_true", help=json_help)
    _command(sub, "clean", cmd_clean, "remove this host's shared memory of a job",
             "Remove this host's shared-memory slots of the job that saves to DIR, and the run directories "
             "(socket, locks, log) of its savers that are no longer running.")
    persist = _command(sub, "persist", cmd_persist, "persist and commit the newest step held in this host's memory",
                       "Write the newest step that every rank of this host holds complete in shared memory, if it "
                       "is newer than the newest commit; the node that holds rank 0 commits it. Run it on each "
                       "node. A progress bar goes to stderr.")
    persist.add_argument("--from-replicas", action="store_true",
                         help="also persist the ranks this host holds only as peer replicas (their node is gone), "
                              "so that this host writes the whole step")
    persist.add_argument("--commit-timeout", type=float, default=None, metavar="SECONDS",
                         help="how long to wait for the other nodes' ranks (default: the job's commit timeout)")
    persist.add_argument("--json", action="store_true", help=json_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _CommandError as exc:
        print(f"flashckpt: {exc}", file=sys.stderr)
        return exc.code
    except FlashCkptError as exc:
        print(f"flashckpt: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
