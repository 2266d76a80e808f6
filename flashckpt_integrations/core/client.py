"""The trainer's side of the saver: find or start the node's saver and talk to it.

Names are scoped by user and job: the run directory is ``<base>/flashckpt-<uid>/<job>-<node>``
(mode 0700, checked on every use) and holds the saver's socket, lock and log; shared-memory
slots are ``/dev/shm/flashckpt-<uid>-<job>-r<rank>-<k>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from .. import knobs
from .._utils.locks import lock_held, same_file
from ..errors import SaverProcessError
from .protocol import LOCK_NAME, LOG_NAME, SLOTS_FILE, SOCKET_NAME, SPAWN_LOCK_NAME, TrainerOp

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107
"""Longest path of a Unix socket on Linux (``sun_path`` holds 108 bytes with the terminating NUL)."""


def job_key(job_id: str) -> str:
    """A short, filesystem-safe key for a job id."""
    return hashlib.sha1(job_id.encode()).hexdigest()[:12]


def job_id_for(checkpoint_url: str | None, job_id: str | None = None) -> str | None:
    """The id of the job that saves to ``checkpoint_url``, resolved the one way every part of the
    package does (the Checkpointer, the launcher, ``flashckpt``): ``job_id`` when one was given
    (``CheckpointerConfig.job_id``, ``--job-id``), else ``$FLASHCKPT_JOB_ID``, else the checkpoint
    directory's URL itself (None when there is none)."""
    return job_id or knobs.get(knobs.JOB_ID) or checkpoint_url


def private_dir(path: str) -> str:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    while True:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        try:
            st = os.lstat(path)
            break
        except FileNotFoundError:  # an exiting saver removed its run directory just now: make it anew
            continue
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise SaverProcessError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700, found uid "
            f"{st.st_uid} mode {oct(stat.S_IMODE(st.st_mode))}. Remove it, or set {knobs.RUN_DIR} "
            "to a private directory."
        )
    return path


def user_run_root() -> str:
    base = knobs.get(knobs.RUN_DIR)
    if base is None:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = xdg if xdg and os.access(xdg, os.W_OK) else "/tmp"
    return private_dir(os.path.join(base, f"flashckpt-{os.getuid()}"))


def saver_running(run_dir: str) -> bool:
    """Whether a saver runs for ``run_dir``: it holds ``saver.lock`` from just after it starts until it exits."""
    return lock_held(os.path.join(run_dir, LOCK_NAME))


def run_dir_for(job: str, node: str) -> str:
    path = os.path.join(user_run_root(), f"{job}-{node}")
    socket_path = os.path.join(path, SOCKET_NAME)
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise SaverProcessError(
            f"the saver's socket path {socket_path} is {len(os.fsencode(socket_path))} bytes long, and a Unix "
            f"socket path may have at most {MAX_SOCKET_PATH}; set {knobs.RUN_DIR} (or XDG_RUNTIME_DIR) to a "
            "shorter directory"
        )
    return private_dir(path)


class SaverClient:
    """A connection from one rank to its node's saver."""

    def __init__(self, run_dir: str, rank: int, *, start_timeout: float = 60.0,
                 hello: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.start_timeout = start_timeout
        self.hello = dict(hello or {})
        """Sent with every hello, so that a restarted saver learns it again (e.g. ``replication``)."""
        self.replica_pushes = True
        """Whether the saver wants each sealed slot offered for its peers (its answer to the hello)."""
        self._connect_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._greeted: socket.socket | None = None
        """The connection whose hello the saver answered (its answer comes after it has taken up
        what this rank's earlier process left behind: see ``saver``)."""
        self._ids = itertools.count(1)
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.saver_pid: int | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.run_dir, SOCKET_NAME)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # --- connection ------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the node's saver, starting it when none answers (from any thread); returns
        once the saver has answered this process's hello."""
        if self._sock is not None and self._greeted is self._sock:
            return
        with self._connect_lock:
            self._connect()

    def _connect(self) -> None:
        if self._sock is not None and self._greeted is self._sock:
            return
        deadline = time.monotonic() + self.start_timeout
        last_spawn = -1e9
        while not self._try_connect():
            if time.monotonic() - last_spawn > 5.0:
                last_spawn = time.monotonic()
                if self._spawn_if_absent():
                    return
            if time.monotonic() > deadline:
                raise SaverProcessError(
                    f"the saver for {self.run_dir} did not come up within {self.start_timeout}s; "
                    f"see {os.path.join(self.run_dir, LOG_NAME)}"
                )
            time.sleep(0.05)

    def _try_connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            return False
        self._sock = sock
        reader = threading.Thread(target=self._read_loop, name="flashckpt-saver-reader", daemon=True)
        reader.start()
        self._reader = reader  # started before it is seen: close() may run meanwhile (at exit) and join it
        try:
            reply = self.request({**self.hello, "op": TrainerOp.HELLO, "rank": self.rank,
                                  "pid": os.getpid()}).result(self.start_timeout)
        except Exception:
            self._disconnect()
            return False
        self.saver_pid = reply.get("pid")
        self._greeted = sock
        self.replica_pushes = bool(reply.get("replica_pushes", True))
        return True

    def _spawn_if_absent(self) -> bool:
        """Start a saver unless one answers once the spawn lock is ours; True when connected."""
        fd = self._spawn_lock()
        try:
            if self._try_connect():
                return True
            if saver_running(self.run_dir):  # one is starting: connect once it listens, start no other
                return False
            proc = self._start_saver()  # it replaces a stale socket itself, once the saver lock is its
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline:
                if self._try_connect():
                    if proc is not None and self.saver_pid != proc.pid:  # another one answered: ours is spare
                        proc.terminate()
                    return True
                if proc is not None and proc.poll() is not None:  # it died while starting: do not wait
                    return self._try_connect()
                time.sleep(0.02)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return False

    def _spawn_lock(self) -> int:
        """Hold the run directory's spawn lock (made anew, with the directory, when the saver of an
        earlier run removed them on its way out)."""
        lock_path = os.path.join(self.run_dir, SPAWN_LOCK_NAME)
        while True:
            private_dir(self.run_dir)
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # the directory went between the two calls
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            if same_file(fd, lock_path):
                return fd
            os.close(fd)  # unlinked by the exiting saver while this waited for it

    def _start_saver(self) -> subprocess.Popen | None:
        """Start the node's saver; return its process (overrides may return None: not watched)."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        # The saver runs with cwd=/; the training script's folder goes along, so that a storage
        # factory kept beside the script imports there as it does here.
        script_dir = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"), script_dir) if p)
        log = open(os.path.join(self.run_dir, LOG_NAME), "ab")  # noqa: SIM115 - handed to the child
        with log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashckpt_integrations.core.saver", "--run-dir", self.run_dir,
                 "--watch-pid", str(os.getppid()), "--idle-exit", knobs.get(knobs.SAVER_IDLE_EXIT, "300")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                start_new_session=True, env=env, cwd="/",
            )
        logger.info("[RANK %d] started saver pid %d for %s", self.rank, proc.pid, self.run_dir)
        return proc

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    # --- messages --------------------------------------------------------------------------

    def request(self, message: dict[str, Any]) -> Future:
        """Send ``message``; the future resolves with the saver's reply."""
        future: Future = Future()
        with self._lock:
            sock = self._sock
            if sock is None:
                future.set_exception(SaverProcessError("not connected to the saver"))
                return future
            rid = next(self._ids)
            self._futures[rid] = future
            try:
                sock.sendall((json.dumps({**message, "id": rid}) + "\n").encode())
            except OSError as exc:
                self._futures.pop(rid, None)
                if self._sock is sock:  # the saver is gone: the next connect() finds or starts another
                    self._sock = None
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                future.set_exception(SaverProcessError(f"lost the saver connection: {exc}"))
        return future

    def _read_loop(self) -> None:
        sock = self._sock
        buffer = b""
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                reply = json.loads(line)
                with self._lock:
                    future = self._futures.pop(reply.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            if self._sock is sock:
                self._sock = None
        for future in futures:
            if not future.done():
                future.set_exception(SaverProcessError("the saver process exited before it answered"))

    def close(self, clean: bool) -> None:
        if clean:  # the rank's slots go with it: no saver needs to find them, and the run directory may go
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.run_dir, SLOTS_FILE.format(rank=self.rank)))
        if self._sock is None:
            return
        with contextlib.suppress(Exception):
            self.request({"op": TrainerOp.CLOSE, "rank": self.rank, "clean": clean}).result(10)
        self._disconnect()
        if self._reader is not None:
            self._reader.join(timeout=5)
