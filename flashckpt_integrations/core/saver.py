"""The saver: one process per node per job that persists the ranks' slots to storage.

It is started as its own program (``python -m flashckpt_integrations.core.saver``), never as
a fork of a trainer, by the first rank of the node that finds none running (a lock file decides
which). It listens on a Unix socket in the job's private run directory. For each persist
request it writes the rank's files from its slot through the storage layer, then the rank's
done marker; the saver that serves global rank 0 is the job's committer: it waits for every
rank's marker, writes the commit record and the tracker, then applies retention.

It outlives a crashed trainer (finishing what it was given), so the restarted trainer finds
it again, and it exits once nothing is left in flight and the job is over: every rank closed
cleanly, or the launcher process it watches is gone and no rank is connected, or no rank has
been connected for ``--idle-exit`` seconds. The snapshots live in /dev/shm, not in the saver:
a restarted rank that finds no saver starts a new one and still restores from memory.

Wire protocol: one JSON object per line. Requests carry ``op`` ("hello", "persist", "attach",
"close", "ping", and the ``replica_*`` ops of :mod:`.replication`) and an ``id``; the saver
answers each with ``{"id": ..., "ok": bool, "error": str}``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import logging
import os
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import knobs
from .._utils.faults import fault_point
from .._utils.locks import same_file
from ..errors import StorageError
from . import commit as commit_protocol
from . import lineage
from .layout import (
    COMMITTED,
    DELETING,
    Layout,
    commit_records,
    marked_steps,
    marker_name,
    now,
    read_json,
    write_json,
    write_rank_done,
    write_rank_failed,
)
from .protocol import LOCK_NAME, LOG_NAME, SLOTS_FILE, SOCKET_NAME, SPAWN_LOCK_NAME
from .replication import Replication
from .retention import RetentionPolicy
from .shm_buffer import Slot, SlotState
from .storage import ENTRY_POINT_GROUP, Storage, remove_stale_temporaries, storage_from_url
from .writing import write_file

logger = logging.getLogger(__name__)



class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.rank: int | None = None
        self.closed = False
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self.lock, contextlib.suppress(OSError):
            self.sock.sendall(data)


class Saver:
    def __init__(self, run_dir: str, watch_pid: int | None, idle_exit_s: float = 300.0) -> None:
        self.run_dir = run_dir
        self.watch_pid = watch_pid
        self.idle_exit_s = idle_exit_s
        self.idle_since = time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.connections: dict[int, _Connection] = {}
        self.registered: set[int] = set()
        self.closed_clean: set[int] = set()
        self.lost_ranks = False
        """A rank disconnected without closing (crashed or killed) while this saver served."""
        self.unclaimed: set[tuple[str, int]] = set()
        """Recovered requests (slot, seq) that no live rank asked for since: their trainer died."""
        self.executors: dict[int, ThreadPoolExecutor] = {}
        self.commit_executor = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self.pending = 0
        self.pending_lock = threading.Lock()
        self.storages: dict[str, Storage] = {}
        self.slots: dict[str, Slot] = {}
        self.recovered: set[tuple[str, int]] = set()
        self.storage_lock = threading.Lock()
        self.started = time.monotonic()
        self.replication = Replication(run_dir, self._storage)
        """Peer replicas of the ranks' snapshots (off until a rank's hello turns it on)."""

    # --- lifecycle -------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)
        logger.info("saver %d serving %s (watching pid %s)", os.getpid(), self.run_dir, self.watch_pid)
        self.recover()
        while not self._should_exit():
            for key, _ in self.selector.select(timeout=0.5):
                if key.data is None:
                    self._accept(listener)
                else:
                    self._read(key.data)
        logger.info("saver %d exiting", os.getpid())
        for executor in [*self.executors.values(), self.commit_executor]:
            executor.shutdown(wait=True)
        self.replication.close(remove=bool(self.registered) and self.registered <= self.closed_clean)

    def _should_exit(self) -> bool:
        with self.pending_lock:
            busy = self.pending > 0
        if busy or self.connections:
            self.idle_since = time.monotonic()
            return False
        if self.registered and self.registered <= self.closed_clean:
            logger.info("every rank closed cleanly; the job is over")
            return True
        if self.watch_pid and self.watch_pid != 1 and not _pid_alive(self.watch_pid):
            logger.info("launcher pid %d is gone and no rank is connected", self.watch_pid)
            return True
        if time.monotonic() - self.idle_since > self.idle_exit_s:
            # Memory snapshots live in /dev/shm, not here: a restarted rank starts a new saver.
            logger.info("no rank connected and nothing to do for %.0fs", self.idle_exit_s)
            return True
        return False

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        conn = _Connection(sock)
        self.connections[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buffer += data
        while b"\n" in conn.buffer:
            line, conn.buffer = conn.buffer.split(b"\n", 1)
            if line.strip():
                self._handle(conn, line)

    def _drop(self, conn: _Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        self.connections.pop(conn.sock.fileno(), None)
        conn.closed = True
        conn.sock.close()
        if conn.rank is not None and conn.rank not in self.closed_clean:
            logger.warning("rank %d disconnected without closing (crashed or killed)", conn.rank)
            self.lost_ranks = True
            self.recover()

    def recover(self, *, dead_only: bool = False) -> None:
        """Persist the snapshots that a trainer asked to persist but did not live to hand over.

        Each rank records its slot paths in the run directory, and a slot that is to be persisted
        says so in its header and carries the request in its metadata. A request the saver already
        has is recognised in ``persist`` (the rank's marker names the same snapshot) and skipped.
        ``dead_only``: only the outstanding requests of processes that are gone (a rank killed
        before its hello reached the saver is seen at the next hello, not at a disconnection).
        """
        for record in glob.glob(os.path.join(self.run_dir, SLOTS_FILE.format(rank="*"))):
            try:
                with open(record) as f:
                    paths = json.load(f)["slots"]
            except (OSError, ValueError, KeyError):
                continue
            for path in paths:
                request, outstanding = _slot_request(path)
                if request is None or (path, int(request["seq"])) in self.recovered:
                    continue
                if dead_only and (not outstanding or not isinstance(request.get("pid"), int)
                                  or _pid_alive(request["pid"])):
                    continue
                if outstanding:
                    self.recovered.add((path, int(request["seq"])))
                    self.unclaimed.add((path, int(request["seq"])))
                    logger.warning("rank %s asked to persist step %s and did not see it through (it died, or "
                                   "this saver was not up yet); persisting it now", request.get("rank"),
                                   request.get("step"))
                    self._submit(None, {**request, "op": "persist", "id": None, "recovered": True})
                elif int(request["rank"]) == 0:  # persisted; the commit may have been cut short
                    self.recovered.add((path, int(request["seq"])))
                    with self.pending_lock:
                        self.pending += 1
                    self.commit_executor.submit(self._finish_interrupted_commit, request)

    def _finish_interrupted_commit(self, request: dict[str, Any]) -> None:
        """Commit a save whose rank-0 files are durable but that has neither a commit nor a failure
        record, or finish moving a superseding save into place."""
        try:
            layout, step, sid = Layout(**request["layout"]), int(request["step"]), request.get("sid", "")
            storage = self._storage(request)
            names = set(storage.list(layout.marker_dir(step)))
            outcome, _ = commit_protocol.settled(storage, step, sid, names)
            if outcome == "committed":
                commit_protocol.finish_switch(storage, layout, step)  # its files may not be in place yet
                return
            if outcome == "failed" or marker_name(0, sid) not in names:
                return
            if read_json(storage, layout.rank_marker(step, 0, sid=sid)).get("seq") != int(request["seq"]):
                return
            logger.warning("the commit of step %d was interrupted; committing it now", step)
            self.commit(request)
        except Exception as exc:
            logger.error("could not finish the interrupted commit of step %s: %s", request.get("step"), exc)
        finally:
            with self.pending_lock:
                self.pending -= 1

    # --- requests --------------------------------------------------------------------------

    def _handle(self, conn: _Connection, line: bytes) -> None:
        try:
            request = json.loads(line)
            op = request["op"]
        except (ValueError, KeyError) as exc:
            conn.send({"id": None, "ok": False, "error": f"bad request: {exc}"})
            return
        rid = request.get("id")
        if op == "hello":
            conn.rank = int(request["rank"])
            self.registered.add(conn.rank)
            self.closed_clean.discard(conn.rank)
            if request.get("replication"):
                self.replication.configure(request["replication"])
            self.recover(dead_only=True)  # a rank that died before it said hello left its request unsent
            conn.send({"id": rid, "ok": True, "pid": os.getpid(), "replica_pushes": self.replication.wants_pushes()})
        elif op == "ping":
            conn.send({"id": rid, "ok": True, "pid": os.getpid()})
        elif op == "close":
            if request.get("clean"):
                self.closed_clean.add(int(request["rank"]))
            conn.send({"id": rid, "ok": True})
        elif op == "persist":
            self.unclaimed.discard((request.get("slot"), int(request.get("seq", -1))))
            self._submit(conn, request)
        elif op.startswith("replica_"):
            self.replication.handle(conn, request)
        elif op == "attach":
            # Map (and pre-fault) a new or grown slot now, so its first persist does not pay it.
            self._executor(int(request["rank"])).submit(self._attach_quietly, request["slot"])
            conn.send({"id": rid, "ok": True})
        else:
            conn.send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})

    def _submit(self, conn: _Connection | None, request: dict[str, Any]) -> None:
        rank = int(request["rank"])
        with self.pending_lock:
            self.pending += 1
        self._executor(rank).submit(self._persist_and_reply, conn, request)

    def _executor(self, rank: int) -> ThreadPoolExecutor:
        """One thread per rank: a rank's slots are only touched by its own thread, in order."""
        executor = self.executors.get(rank)
        if executor is None:
            executor = self.executors[rank] = ThreadPoolExecutor(1, thread_name_prefix=f"persist-r{rank}")
        return executor

    def _attach_quietly(self, path: str) -> None:
        try:
            self._slot(path)
        except Exception as exc:  # the persist that needs it reports any real problem
            logger.debug("could not map slot %s ahead of time: %s", path, exc)

    def _persist_and_reply(self, conn: _Connection | None, request: dict[str, Any]) -> None:
        """Persist for a connected rank (``conn``) or a recovered request (None: nobody to answer)."""
        try:
            reply = {"id": request.get("id"), "ok": True, "error": None}
            try:
                self.persist(request, lambda: conn is None or not conn.closed)
            except Exception as exc:  # reported to the rank and logged; the saver carries on
                logger.error("persist of step %s rank %s failed: %s\n%s", request.get("step"),
                             request.get("rank"), exc, traceback.format_exc())
                reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            # Rank 0 is answered once the step is committed or failed: its slot is kept until then,
            # and if this saver dies first, the rank asks a new one, which finishes the commit.
            if int(request["rank"]) == 0:
                with self.pending_lock:
                    self.pending += 1
                self.commit_executor.submit(self._commit_and_release, request, reply, conn)
            elif conn is not None:
                conn.send(reply)
        finally:
            with self.pending_lock:
                self.pending -= 1

    def _commit_and_release(self, request: dict[str, Any], reply: dict[str, Any], conn: _Connection | None) -> None:
        try:
            def answer(error: str | None) -> None:
                if error is not None and reply["ok"]:
                    reply.update(ok=False, error=error)
                if conn is not None:
                    conn.send(reply)

            self.commit(request, reply["error"], answer=answer)
        finally:
            with self.pending_lock:
                self.pending -= 1

    def _storage(self, request: dict[str, Any]) -> Storage:
        spec = [request["root"], request.get("storage_options"), request.get("storage_factory")]
        key = json.dumps(spec, sort_keys=True)
        with self.storage_lock:
            if key not in self.storages:
                try:
                    self.storages[key] = storage_from_url(
                        request["root"], request.get("storage_options"), request.get("storage_factory")
                    )
                except Exception as exc:
                    raise StorageError(_cannot_open(request, exc)) from exc
            return self.storages[key]

    def _slot(self, path: str) -> Slot:
        """The saver's mapping of a slot, kept (pre-faulted) between persists of the same rank.

        Only the rank's own persist thread uses it; it is remapped when the trainer grew or
        recreated the slot.
        """
        slot = self.slots.get(path)
        if slot is not None and (slot.replaced() or slot.file_size() != slot.size):
            slot.close()
            slot = None
        if slot is None:
            slot = Slot.attach(path, populate=True)
            if slot is None:
                raise FileNotFoundError(f"slot {path} does not exist")
            self.slots[path] = slot
        return slot

    def persist(self, request: dict[str, Any], alive: Callable[[], bool] = lambda: True) -> None:
        """Write one rank's files for one step, then its done marker (or failed marker).

        The slot may still be filling (a streaming persist): each region is written once the
        trainer says it is in place, and the rank's files count only once the slot is sealed.
        ``alive()`` says whether the rank is still connected.
        """
        rank, step, seq = int(request["rank"]), int(request["step"]), int(request["seq"])
        layout = Layout(**request["layout"])
        started = time.monotonic()
        slot = self._slot(request["slot"])
        slot.lock()
        try:
            try:
                storage = self._storage(request)
            except Exception:
                slot.mark_persist_done(seq)  # reported to the rank; no later saver retries it
                raise
            try:
                if commit_protocol.already_persisted(storage, layout, request,
                                                     recovered=bool(request.get("recovered"))):
                    return
                _check_directory(storage, request)
                base = commit_protocol.claim(storage, layout, request)
                metadata = _checked_metadata(slot, step, seq, filling=True)
                entries = []

                def ready(index: int) -> None:
                    _wait_until_copied(slot, step, seq, index + 1, alive)
                    fault_point("saver.write")  # part of the file is written

                for fmeta in metadata["files"]:
                    entry = write_file(storage, f"{base}/{fmeta['path']}", fmeta, metadata["regions"], slot, ready)
                    entry["path"] = fmeta["path"]
                    entry["codec"] = fmeta["codec"]
                    entries.append(entry)
                _wait_until_copied(slot, step, seq, None, alive)  # sealed: every byte was in place
                _checked_metadata(slot, step, seq)
                # a saver killed while writing these files left temporaries that would be committed with them
                remove_stale_temporaries(storage, [f"{base}/{e['path']}" for e in entries])
                write_rank_done(storage, layout, request, entries, base)
            except Exception as exc:
                write_rank_failed(storage, layout, request, exc)
                raise
            finally:
                slot.mark_persist_done(seq)
        finally:
            slot.unlock()
            if request.get("held"):  # the trainer's extra slot from before the saver was up: it goes soon
                self.slots.pop(request["slot"], None)
                slot.close()
        total = sum(e["size"] for e in entries)
        elapsed = time.monotonic() - started
        logger.info("rank %d step %d persisted: %d files, %.1f MiB in %.2fs", rank, step, len(entries),
                    total / 2**20, elapsed)

    def commit(self, request: dict[str, Any], local_error: str | None = None,
               answer: Callable[[str | None], Any] = lambda error: None) -> None:
        """Committer (the saver of global rank 0): commit once every rank's marker exists
        (:func:`.commit.commit`), answer, then apply retention.

        ``answer(error)`` is called once the step is committed (``None``) or failed (the reason),
        before retention; it is called whatever goes wrong, storage that cannot be opened included.
        """
        try:
            storage = self._storage(request)
            committed = commit_protocol.commit(storage, request, local_error)
        except Exception as exc:
            error = f"step {request.get('step')} was not committed: {type(exc).__name__}: {exc}"
            logger.error("%s", error)
            answer(error)
            return
        answer(None)  # committed, or failed with its FAILED record on storage
        if committed:
            self.purge(storage, Layout(**request["layout"]), RetentionPolicy(**(request.get("retention") or {})))

    def purge(self, storage: Storage, layout: Layout, policy: RetentionPolicy) -> None:
        """Delete what the retention policy lets go; a failure is logged and retention goes on."""
        if not policy.enabled:
            return
        records = commit_records(storage)
        self._finish_deletions(storage, records)
        for step in policy.select_deletions(list(records), key=lambda s: lineage.order_key(records[s], s)):
            started = time.monotonic()
            try:
                # The tombstone first: a pass cut short below leaves a step that says it is being deleted.
                write_json(storage, f"{layout.marker_dir(step)}/{DELETING}",
                           {"step": step, "files": layout.step_path(step), "record": records[step], "time": now()})
                storage.remove(f"{layout.marker_dir(step)}/{COMMITTED}")
                fault_point("retention.delete")  # uncommitted, its files not yet deleted
                storage.remove(layout.step_path(step))
                storage.remove(layout.marker_dir(step))
            except Exception as exc:
                logger.error("retention could not delete step %d: %s", step, exc)
                continue
            logger.info("retention deleted step %d in %.2fs", step, time.monotonic() - started)

    def _finish_deletions(self, storage: Storage, records: dict[int, dict[str, Any]]) -> None:
        """Finish deleting the steps that a retention pass marked DELETING and did not see through
        (its process was killed): their files and markers would otherwise stay on storage forever.

        A step with a tombstone and no commit record is such a leftover, unlike a save in flight,
        whose done markers look the same. Only steps older than the newest commit (the one this
        pass follows) are touched: every save still in flight is newer than that one, so none of
        them is writing into the directory of the step being finished. A tombstone next to a
        commit record (a kill before that record went, or the step saved and committed again) is
        left alone: the policy decides about a committed step afresh.
        """
        if not records:
            return
        newest = max(records, key=lambda s: lineage.order_key(records[s], s))
        for step in marked_steps(storage):
            if step >= newest or step in records:
                continue
            marker_dir = Layout.marker_dir(step)
            try:
                if DELETING not in storage.list(marker_dir):
                    continue
                tombstone = read_json(storage, f"{marker_dir}/{DELETING}")
                storage.remove(tombstone["files"])
                storage.remove(marker_dir)
            except Exception as exc:
                logger.error("retention could not finish deleting step %d: %s", step, exc)
                continue
            logger.warning("retention finished deleting step %d, which an interrupted pass had left on storage", step)


def _cannot_open(request: dict[str, Any], exc: BaseException) -> str:
    """Why the saver could not open a request's storage, and what to do about it."""
    factory, root = request.get("storage_factory"), request["root"]
    scheme = root.split("://", 1)[0] if "://" in root else ""
    said = f"the saver could not open the storage {root!r}: {type(exc).__name__}: {exc}"
    if factory:
        return (f"{said}. The saver is a separate process: storage_factory {factory!r} must be importable in "
                "the saver, which runs with cwd=/, the trainer's environment and the training script's folder "
                "on its PYTHONPATH: put the factory in an installed package, beside the script, or on PYTHONPATH")
    if scheme not in ("", "file"):
        return (f"{said}. The saver is a separate process: a scheme registered with register_storage() exists "
                f"only in the process that registered it; declare it through the {ENTRY_POINT_GROUP!r} entry "
                "point group, or pass storage_factory='package.module:factory'")
    return said


def _slot_request(path: str) -> tuple[dict[str, Any] | None, bool]:
    """The persist request kept in the complete slot ``path`` (or None), and whether no saver finished it."""
    try:
        slot = Slot.attach(path, populate=False)
    except Exception:
        return None, False
    if slot is None:
        return None, False
    try:
        header = slot.read_header()
        if header is None or header.state is not SlotState.COMPLETE or header.persist_req != header.seq:
            return None, False
        return slot.read_metadata(header).get("persist"), header.persist_done < header.persist_req
    except Exception as exc:
        logger.warning("could not read slot %s: %s", path, exc)
        return None, False
    finally:
        slot.close()


def _check_directory(storage: Storage, request: dict[str, Any]) -> None:
    """Refuse to persist a snapshot into a directory that was deleted or replaced since it was taken."""
    expected = (request.get("tag") or {}).get("dir")
    if expected is None:
        return
    found = lineage.read_identity(storage)
    if found != expected:
        raise RuntimeError(
            f"the checkpoint directory {request['root']} was deleted or replaced after step {request['step']} "
            f"was snapshotted (identity {expected}, now {found}); this snapshot belongs to the old directory "
            "and is not written into the new one"
        )


def _checked_metadata(slot: Slot, step: int, seq: int, *, filling: bool = False) -> dict[str, Any]:
    """The slot's metadata, checked to be this step's; ``filling`` also accepts a slot being written."""
    header = slot.read_header()
    states = (SlotState.COMPLETE, SlotState.WRITING) if filling else (SlotState.COMPLETE,)
    if header is None or header.state not in states or header.seq != seq or header.step != step:
        raise RuntimeError(
            f"slot {slot.path} no longer holds step {step} (seq {seq}): found "
            f"{header and (header.state.name, header.step, header.seq)}"
        )
    return slot.read_metadata(header)


def _wait_until_copied(slot: Slot, step: int, seq: int, regions: int | None, alive: Callable[[], bool]) -> None:
    """Wait until the first ``regions`` regions are in place (``None``: until the slot is sealed)."""
    delay = 0.0002
    while True:
        header = slot.read_header()
        if header is None or header.seq != seq or header.step != step or header.state is SlotState.EMPTY:
            raise RuntimeError(f"the snapshot of step {step} was abandoned while it was being written")
        if header.state is SlotState.COMPLETE or (regions is not None and slot.copied() >= regions):
            return
        if not alive():
            raise RuntimeError(f"the rank disconnected while its snapshot of step {step} was being written")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lower_session(nice: int) -> None:
    """Put the saver's session below the trainers too, where the kernel schedules by session.

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in many
    distributions) a niceness orders threads only within their session, and each session gets an
    equal share of a busy CPU: a saver in a session of its own (it is started with one, to outlive
    a trainer's process group) would take as much CPU as all of a node's trainers together, nice or
    not. Its session's own niceness is lowered as well, only when the saver leads that session.
    """
    if nice <= 0 or os.getsid(0) != os.getpid():
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as exc:  # no autogroup in this kernel (or in this cgroup): niceness alone holds
        logger.debug("session niceness not set: %s", exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flashckpt node saver (started by the trainers)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--watch-pid", type=int, default=None,
                        help="the launcher's pid: once it is gone and no rank is connected, exit")
    parser.add_argument("--idle-exit", type=float, default=300.0,
                        help="exit after this many seconds with no rank connected and nothing in flight")
    parser.add_argument("--log-level", default=os.environ.get("FLASHCKPT_SAVER_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s saver[%(process)d] %(levelname)s %(message)s")
    # Below the trainers: persisting is background work and must not slow the training steps down.
    # (Set before any thread starts: threads inherit it.)
    with contextlib.suppress(OSError, ValueError):
        nice = int(knobs.get(knobs.SAVER_NICE, "10"))
        os.nice(nice)
        _lower_session(nice)

    lock_fd = _lock_run_dir(args.run_dir)
    if lock_fd is None:
        logger.info("another saver holds the lock for %s; exiting", args.run_dir)
        return 0
    # What an earlier saver of this directory logged (it crashed, or its job did) stays readable.
    told_before = False
    with contextlib.suppress(OSError):
        told_before = os.path.getsize(os.path.join(args.run_dir, LOG_NAME)) > 0
    trouble = _Trouble()
    logging.getLogger().addHandler(trouble)
    path = os.path.join(args.run_dir, SOCKET_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(256)
    saver = Saver(args.run_dir, args.watch_pid, args.idle_exit)
    try:
        saver.serve(listener)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.close()
    if knobs.get(knobs.SAVER_KEEP_RUN_DIR):
        return 0
    # The directory (and the log) go only after an uneventful job: every rank closed cleanly, none
    # was lost on the way, nothing failed, and no earlier saver (crashed, or of a crashed job) left its log.
    why = ("the job did not close cleanly" if not saver.registered or not saver.registered <= saver.closed_clean
           else "a rank was lost" if saver.lost_ranks or saver.unclaimed else "an error was logged" if trouble.seen
           else "an earlier saver logged here" if told_before else None)
    if why is None:
        _remove_run_dir(args.run_dir)
    else:
        logger.info("keeping %s and this log: %s", args.run_dir, why)
    return 0


class _Trouble(logging.Handler):
    """Notes whether the saver logged an error (then its run directory and log stay)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


def _lock_run_dir(run_dir: str) -> int | None:
    """Hold ``saver.lock`` of ``run_dir`` (the file its path names now); None when another saver holds it."""
    path = os.path.join(run_dir, LOCK_NAME)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if same_file(fd, path):
            return fd
        os.close(fd)  # the saver before this one unlinked it on its way out: lock the new one


def _remove_run_dir(run_dir: str) -> None:
    """Remove the run directory at the end of a job that every rank closed cleanly.

    Called with ``saver.lock`` held and the socket gone. It goes only when it holds nothing but
    this saver's own files (a slot record belongs to a rank that did not close cleanly, or to
    the next run of the job starting already) and no rank holds the spawn lock (one is starting
    a saver). The lock files are unlinked while they are held: a rank or saver that opened one
    before checks, once it holds it, that it is still the file of that name. A rank that writes
    into the directory meanwhile makes the final ``rmdir`` fail, and the directory stays.
    """
    own = {LOCK_NAME, SPAWN_LOCK_NAME, LOG_NAME}
    spawn_fd = None
    try:
        with contextlib.suppress(FileNotFoundError):
            spawn_fd = os.open(os.path.join(run_dir, SPAWN_LOCK_NAME), os.O_RDWR)
            fcntl.flock(spawn_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        others = set(os.listdir(run_dir)) - own
        if others:
            logger.info("keeping %s: it holds %s", run_dir, ", ".join(sorted(others)))
            return
        for name in (LOG_NAME, SPAWN_LOCK_NAME, LOCK_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(run_dir, name))
        os.rmdir(run_dir)
    except BlockingIOError:
        logger.info("keeping %s: a rank is starting a saver in it", run_dir)
    except OSError as exc:  # e.g. not empty: a rank of the next run wrote into it just now
        logger.info("keeping %s: %s", run_dir, exc)
    finally:
        if spawn_fd is not None:
            os.close(spawn_fd)


if __name__ == "__main__":
    sys.exit(main())
