"""The saver: one process per node per job that persists the ranks' slots to storage.

It is started as its own program (``python -m flashckpt_integrations.core.saver``), never as
a fork of a trainer, by the first rank of the node that finds none running (a lock file decides
which). It listens on a Unix socket in the job's private run directory. For each persist
request it writes the rank's files from its slot through the storage layer, then the rank's
done marker; the saver that serves global rank 0 is the job's committer: it waits for every
rank's marker, writes the commit record and the tracker, then applies retention (both through
:class:`.persister.Persister`; this module is the process: socket, connections, the ops,
recovery of what dead ranks left, when to exit).

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
import functools
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
from .._utils.locks import same_file
from .._utils.procs import pid_alive
from . import commit as commit_protocol
from . import preemption, verify
from .layout import Layout, marker_name, read_json
from .persister import Persister
from .protocol import LOCK_NAME, LOG_NAME, SOCKET_NAME, SPAWN_LOCK_NAME, TrainerOp
from .replication import Replication
from .rescue import run_dir_slots
from .shm_buffer import Slot, SlotState

logger = logging.getLogger(__name__)

COMMIT_THREADS = 8
"""Commits that may wait for their markers at once (a rank has at most a few persists in flight)."""
SUPERSEDED_GRACE_S = 10.0
"""The least a commit of a relaunched job's earlier attempt still waits for its missing markers."""


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.rank: int | None = None
        self.writer: dict[str, Any] = {}
        """The identity (pid, token) its process writes into its snapshots' metadata."""
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
        self.persister = Persister()
        self.commit_executor = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="commit")
        """Commits wait for their markers side by side (:mod:`.persister` switches them one at a time)."""
        self.writers: dict[int, dict[str, Any]] = {}
        """The identity of each rank's newest process that said hello (see :meth:`_gave_way`)."""
        self.pending = 0
        self.persisting = 0
        """Persists submitted and not finished (``pending`` also counts commits)."""
        self.pending_lock = threading.Lock()
        self.stop_deadline: float | None = None
        """Set when the job is being stopped (SIGTERM, SIGINT, a rank's notice): see :mod:`.preemption`."""
        self.stops = preemption.StopRequests()
        self.longest_persist_s = 0.0
        """The longest persist so far: how much of the grace a stopped saver keeps for its drain."""
        self.recovered: set[tuple[str, int]] = set()
        self.started = time.monotonic()
        self.replication = Replication(run_dir, self.persister.storage)
        """Peer replicas of the ranks' snapshots (off until a rank's hello turns it on)."""

    # --- lifecycle -------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)
        logger.info("saver %d serving %s (watching pid %s)", os.getpid(), self.run_dir, self.watch_pid)
        self.recover()
        while self.stop_deadline is None and not self._should_exit():
            self._serve_once(listener, timeout=0.05 if self.stops.pending else 0.5)
            self.stops.settle(self)
        if self.stop_deadline is not None:  # the job is being stopped: see preemption
            settle = time.monotonic() + preemption.SETTLE_S
            while self._ranks_connected() and time.monotonic() < max(settle, preemption.serve_until(self)):
                self._serve_once(listener, timeout=0.05)  # the other ranks' notices come on new connections
                self.stops.settle(self)
            self.selector.unregister(listener)
            self.stops.answer(preemption.drain(self))
            logger.info("saver %d exiting", os.getpid())
            self.replication.close(remove=False)
            return
        logger.info("saver %d exiting", os.getpid())
        for executor in [*self.executors.values(), self.commit_executor]:
            executor.shutdown(wait=True)
        self.replication.close(remove=bool(self.registered) and self.registered <= self.closed_clean)

    def _serve_once(self, listener: socket.socket, timeout: float = 0.5) -> None:
        for key, _ in self.selector.select(timeout=timeout):
            if key.data is None:
                self._accept(listener)
            else:
                self._read(key.data)

    def _should_exit(self) -> bool:
        with self.pending_lock:
            busy = self.pending > 0
        if busy or self.connections:
            self.idle_since = time.monotonic()
            return False
        if self.registered and self.registered <= self.closed_clean:
            logger.info("every rank closed cleanly; the job is over")
            return True
        if not self._launcher_alive():
            logger.info("launcher pid %d is gone and no rank is connected", self.watch_pid)
            return True
        if time.monotonic() - self.idle_since > self.idle_exit_s:
            # Memory snapshots live in /dev/shm, not here: a restarted rank starts a new saver.
            logger.info("no rank connected and nothing to do for %.0fs", self.idle_exit_s)
            return True
        return False

    def _launcher_alive(self) -> bool:
        return not (self.watch_pid and self.watch_pid != 1 and not pid_alive(self.watch_pid))

    def _ranks_connected(self) -> bool:
        """Whether a trainer is still connected (peer savers and ``flashckpt ls`` do not count)."""
        return any(conn.rank is not None and conn.rank not in self.stops.stopping
                   for conn in list(self.connections.values()))

    def persists_in_flight(self) -> int:
        with self.pending_lock:
            return self.persisting

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
            self.stops.rank_failed()
            self._sum_left_behind(conn.rank, functools.partial(verify.writer_gone, dropped=conn.writer))
            self.recover()

    def _sum_left_behind(self, rank: int, gone: Callable[[Any], bool]) -> None:
        """Checksum the snapshots a dead rank sealed but did not live to checksum: when its
        connection drops, and at every hello of the rank (its last process may have died before
        it connected), before the hello is answered, so a relaunched rank finds them verifiable.
        A table is tagged with its snapshot's seq and written only while the slot still holds
        that snapshot; ``gone`` (:func:`.verify.writer_gone`) keeps a live writer's slots out."""
        for path in run_dir_slots(self.run_dir).get(rank, []):
            try:
                summed = verify.sum_left_behind(path, gone)
            except Exception as exc:  # a damaged or foreign slot: a restore finds it unverified
                logger.warning("could not checksum rank %d's snapshot in %s: %s", rank, path, exc)
                continue
            if summed:
                logger.info("rank %d died before checksumming its snapshot in %s; summed it now", rank, path)

    def recover(self, *, dead_only: bool = False) -> None:
        """Persist the snapshots that a trainer asked to persist but did not live to hand over.

        Each rank records its slot paths in the run directory, and a slot that is to be persisted
        says so in its header and carries the request in its metadata. A request the saver already
        has is recognised in ``persist`` (the rank's marker names the same snapshot) and skipped.
        ``dead_only``: only the outstanding requests of processes that are gone (a rank killed
        before its hello reached the saver is seen at the next hello, not at a disconnection).
        """
        for paths in run_dir_slots(self.run_dir).values():
            for path in paths:
                request, outstanding = _slot_request(path)
                if request is None or (path, int(request["seq"])) in self.recovered:
                    continue
                if dead_only and (not outstanding or not isinstance(request.get("pid"), int)
                                  or pid_alive(request["pid"])):
                    continue
                if outstanding:
                    self.recovered.add((path, int(request["seq"])))
                    self.unclaimed.add((path, int(request["seq"])))
                    logger.warning("rank %s asked to persist step %s and did not see it through (it died, or "
                                   "this saver was not up yet); persisting it now", request.get("rank"),
                                   request.get("step"))
                    self._submit(None, {**request, "op": TrainerOp.PERSIST, "id": None, "recovered": True})
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
            storage = self.persister.storage(request)
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
            self.persister.commit(request, give_way=self._gave_way(request, 0.0))
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
        try:
            self._dispatch(conn, op, request)
        except Exception as exc:  # one bad request never takes the saver (and every rank's persists) down
            logger.error("request %r failed: %s\n%s", op, exc, traceback.format_exc())
            conn.send({"id": request.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    def _dispatch(self, conn: _Connection, op: str, request: dict[str, Any]) -> None:
        rid = request.get("id")
        if op == TrainerOp.HELLO:
            conn.rank = int(request["rank"])
            conn.writer = dict(request.get("writer") or {})
            if conn.writer:
                self.writers[conn.rank] = conn.writer
            self.registered.add(conn.rank)
            self.closed_clean.discard(conn.rank)
            if request.get("replication"):
                self.replication.configure(request["replication"])
            # A rank killed before its hello reached this saver (or before this saver was up) left
            # its sealed snapshots unsummed and its requests unsent: see to both before answering.
            self._sum_left_behind(conn.rank, functools.partial(verify.writer_gone, hello=conn.writer))
            self.recover(dead_only=True)
            conn.send({"id": rid, "ok": True, "pid": os.getpid(), "replica_pushes": self.replication.wants_pushes()})
        elif op == TrainerOp.STOPPING:
            self.stops.ask(conn, request)
        elif op == TrainerOp.PING:
            conn.send({"id": rid, "ok": True, "pid": os.getpid()})
        elif op == TrainerOp.CLOSE:
            if request.get("clean"):
                self.closed_clean.add(int(request["rank"]))
            conn.send({"id": rid, "ok": True})
        elif op == TrainerOp.PERSIST:
            self.unclaimed.discard((request.get("slot"), int(request.get("seq", -1))))
            self._submit(conn, request)
        elif op in (TrainerOp.REPLICA_PUSH, TrainerOp.REPLICA_INVENTORY, TrainerOp.REPLICA_FETCH):
            self.replication.handle(conn, request)
        elif op == TrainerOp.ATTACH:
            # Map (and pre-fault) a new or grown slot now, so its first persist does not pay it;
            # answered once mapped where the rank waits for that (prepare()), else at once.
            mapped = self._executor(int(request["rank"])).submit(self._attach_quietly, request["slot"])
            if request.get("answer") == "mapped":
                mapped.add_done_callback(lambda _: conn.send({"id": rid, "ok": True}))
            else:
                conn.send({"id": rid, "ok": True})
        else:
            conn.send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})

    def _submit(self, conn: _Connection | None, request: dict[str, Any]) -> None:
        rank = int(request["rank"])
        with self.pending_lock:
            self.pending += 1
            self.persisting += 1
        self._executor(rank).submit(self._persist_and_reply, conn, request)

    def _executor(self, rank: int) -> ThreadPoolExecutor:
        """One thread per rank: a rank's slots are only touched by its own thread, in order."""
        executor = self.executors.get(rank)
        if executor is None:
            executor = self.executors[rank] = ThreadPoolExecutor(1, thread_name_prefix=f"persist-r{rank}")
        return executor

    def _attach_quietly(self, path: str) -> None:
        try:
            self.persister.slot(path)
        except Exception as exc:  # the persist that needs it reports any real problem
            logger.debug("could not map slot %s ahead of time: %s", path, exc)

    def _persist_and_reply(self, conn: _Connection | None, request: dict[str, Any]) -> None:
        """Persist for a connected rank (``conn``) or a recovered request (None: nobody to answer)."""
        try:
            reply = {"id": request.get("id"), "ok": True, "error": None}
            started = time.monotonic()
            try:
                self.persister.persist(request, lambda: conn is None or not conn.closed)
            except Exception as exc:  # reported to the rank and logged; the saver carries on
                logger.error("persist of step %s rank %s failed: %s\n%s", request.get("step"),
                             request.get("rank"), exc, traceback.format_exc())
                reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            self.longest_persist_s = max(self.longest_persist_s, time.monotonic() - started)
            # Rank 0 is answered once the step is committed or failed: its slot is kept until then,
            # and if this saver dies first, the rank asks a new one, which finishes the commit.
            if int(request["rank"]) == 0:
                with self.pending_lock:
                    self.pending += 1
                self.commit_executor.submit(self._commit_and_release, request, reply, conn,
                                            time.monotonic() - started)
            elif conn is not None:
                conn.send(reply)
        finally:
            with self.pending_lock:
                self.pending -= 1
                self.persisting -= 1

    def _commit_and_release(self, request: dict[str, Any], reply: dict[str, Any], conn: _Connection | None,
                            persisted_s: float) -> None:
        try:
            def answer(error: str | None) -> None:
                if error is not None and reply["ok"]:
                    reply.update(ok=False, error=error)
                if conn is not None:
                    conn.send(reply)

            self.persister.commit(request, reply["error"], answer=answer,
                                  give_way=self._gave_way(request, persisted_s))
        finally:
            with self.pending_lock:
                self.pending -= 1

    def _gave_way(self, request: dict[str, Any], persisted_s: float) -> Callable[[], str | None]:
        """When a commit stops waiting for the markers of ranks that cannot come: once the process
        that asked for it has been replaced (a new process of its rank said hello: the job was
        relaunched, so the attempt that saved the step is over on this node), after a grace for
        the ranks whose savers are still writing (twice this saver's own persist of the step, at
        least ``SUPERSEDED_GRACE_S``). A rank on a lost node never writes its marker; without this
        the commit would hold its slot's answer until ``commit_timeout_s``."""
        rank, token = int(request["rank"]), (request.get("writer") or {}).get("token")
        grace, since = max(SUPERSEDED_GRACE_S, 2 * persisted_s), [0.0]

        def check() -> str | None:
            newest = (self.writers.get(rank) or {}).get("token")
            if token is None or newest is None or newest == token:
                return None
            since[0] = since[0] or time.monotonic()
            if time.monotonic() - since[0] < grace:
                return None
            return (f"the job was relaunched (a new process of rank {rank} started) and they did not persist it "
                    f"within {grace:.0f}s after that: the attempt that saved it is over")

        return check



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
    preemption.install(saver)
    try:
        saver.serve(listener)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.close()
    if saver.stop_deadline is not None:  # never wait for a commit thread past the grace period
        logging.shutdown()
        os._exit(0)
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
