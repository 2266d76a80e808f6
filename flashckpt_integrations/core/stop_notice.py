"""A rank that gets SIGTERM tells its node's saver before it dies, under any launcher.

When a job is stopped through its launcher alone (Kubernetes sends SIGTERM to a container's
first process, often ``torchrun``, which passes SIGTERM on to its workers and exits once they are
gone), the workers die at once and the launcher right after; where the launcher is the
container's first process, the kernel then kills everything else in it, the saver too. Every
snapshot newer than the last commit would be lost. So a rank's SIGTERM first asks the saver to
persist the newest snapshot every rank of the node holds (the saver's drain, see
:mod:`.preemption`), waits for that, and only then dies of SIGTERM as it would have: the launcher
waits for its workers, so the drain finishes before it exits.

A launcher also sends SIGTERM to the other workers when one of them failed (``torchrun`` does so
before a restart or an exit). The saver tells the two apart: a rank that disconnected without
closing shortly before is a failure, and then it answers at once that nothing is drained, so a
crash restarts as fast as without this.

Call order, in a rank's process:

1. :func:`install` (``Checkpointer.__init__``, main thread): only where SIGTERM still has its
   default action (a script's own handler, :class:`flashckpt_integrations.StopSignal` and HF's
   ``enable_jit_checkpoint`` keep theirs), no signal wakeup fd is set, and
   ``$FLASHCKPT_STOP_NOTICE`` is not ``0`` (``flashckpt-run`` sets it: it persists on SIGTERM
   itself). It sets a Python-level SIGTERM handler and a wakeup fd, and starts one thread.
2. SIGTERM: the interpreter's C-level handler writes the signal number to the wakeup fd at once,
   even while the main thread waits in a collective; the thread sends ``stopping`` to each
   registered saver on a connection of its own and waits for the answer (at most the grace,
   ``$FLASHCKPT_GRACE_S``). The Python-level handler, once the main thread runs Python again,
   waits for the same answer (no more training, no more saves), puts the default action back
   and sends itself SIGTERM. A main thread still stuck in a C call a second after the answer is
   ended by the thread with exit status 143 (128 + SIGTERM).
3. :func:`uninstall` (``Checkpointer.shutdown``): once no registered checkpointer is left, the
   previous handler and wakeup fd are put back.

A child forked from a rank (a ``DataLoader`` worker) is not a rank: right after the fork it gets
the default SIGTERM back and no wakeup fd (the inherited one would carry its signals to the
rank's thread), so a worker terminated by its ``DataLoader`` dies as it always did.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from .. import knobs
from .preemption import grace_s
from .protocol import SOCKET_NAME, TrainerOp

logger = logging.getLogger(__name__)

DIE_AFTER_S = 1.0
"""How long after the saver's answer a main thread stuck in a C call has to die by itself."""


class _Notice:
    """The process's one installed notice (see the module docstring).

    The SIGTERM handler takes no lock: it runs between any two bytecodes of the main thread, which
    may hold any lock at that moment, and a second SIGTERM (the launcher's, after the scheduler's)
    may run it again inside itself. It only writes a byte to the thread's socket and polls a flag.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.targets: dict[int, tuple[str, int]] = {}  # id(checkpointer) -> (run dir, rank); main thread only
        self.snapshot: tuple[tuple[str, int], ...] = ()
        """``targets`` as one immutable value, replaced whole: what the thread reads."""
        self.started = False  # the thread's own
        self.done = False
        self.wait_s = grace_s() + DIE_AFTER_S
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.thread = threading.Thread(target=self._watch, name="flashckpt-stop-notice", daemon=True)

    def set_targets(self, targets: dict[int, tuple[str, int]]) -> None:
        self.targets = targets
        self.snapshot = tuple(sorted(set(targets.values())))

    def on_sigterm(self, signum: int, _frame: Any) -> None:
        """The Python-level handler (main thread): wake the thread, wait for the saver, die of SIGTERM."""
        if os.getpid() == self.pid:  # not in a forked child that kept the handler
            with contextlib.suppress(OSError):
                self.writer.send(bytes([signal.SIGTERM]))  # in case the wakeup fd is no longer ours
            deadline = time.monotonic() + self.wait_s
            while not self.done and time.monotonic() < deadline:
                time.sleep(0.02)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _watch(self) -> None:
        """Wake on the signal numbers the interpreter (or the handler) writes to the socket; the
        first SIGTERM while the handler is installed sends the notice, from this thread."""
        while True:
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if not self.started and signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) == self.on_sigterm:
                self.started = True
                self._notify()
                return

    def _notify(self) -> None:
        deadline = time.monotonic() + self.wait_s - DIE_AFTER_S
        answers = [(rank, ask_saver(run_dir, rank, deadline)) for run_dir, rank in self.snapshot]
        self.done = True  # before logging: the main thread may hold a logging lock, it must not wait on it
        for rank, answer in answers:
            if answer.get("drained"):
                logger.warning("[RANK %d] SIGTERM: the node's saver persisted the newest snapshot (%s); exiting",
                               rank, answer.get("reason", ""))
            else:
                logger.warning("[RANK %d] SIGTERM: exiting (the node's saver: %s)", rank,
                               answer.get("reason") or answer.get("error") or "no answer")
        time.sleep(DIE_AFTER_S)
        os._exit(128 + signal.SIGTERM)  # the main thread is stuck in a C call: end as SIGTERM would have


def local_world_size() -> int | None:
    """The ranks the launcher runs on this node (``LOCAL_WORLD_SIZE``: torchrun, accelerate,
    ``flashckpt-run``); None under a launcher that does not say."""
    try:
        value = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def ask_saver(run_dir: str, rank: int, deadline: float) -> dict[str, Any]:
    """Send ``stopping`` to the saver of ``run_dir`` and wait for its answer until ``deadline``;
    ``{"error": ...}`` when there is none (no saver, or it did not answer in time)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.connect(os.path.join(run_dir, SOCKET_NAME))
            notice = {"op": TrainerOp.STOPPING, "id": 1, "rank": rank, "local_world_size": local_world_size()}
            sock.sendall((json.dumps(notice) + "\n").encode())
            buffer = b""
            while b"\n" not in buffer:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                data = sock.recv(4096)
                if not data:
                    return {"error": "the saver closed the connection"}
                buffer += data
            return json.loads(buffer.split(b"\n", 1)[0])
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


_installed: _Notice | None = None
_install_lock = threading.Lock()
_fork_hook = False


def _forget_in_child() -> None:
    """After a fork, in the child: the default SIGTERM and no wakeup fd (see the module docstring)."""
    global _installed
    notice, _installed = _installed, None
    if notice is None:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) == notice.on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def install(owner: object, run_dir: str, rank: int) -> bool:
    """Register ``owner`` (a checkpointer) for the notice, installing it once per process where
    it applies (see the module docstring); whether the notice covers ``owner``."""
    global _installed, _fork_hook
    with _install_lock:
        if not _fork_hook:
            os.register_at_fork(after_in_child=_forget_in_child)
            _fork_hook = True
        if _installed is not None:
            _installed.set_targets({**_installed.targets, id(owner): (run_dir, rank)})
            return True
        if knobs.get(knobs.STOP_NOTICE, "1") == "0" or threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
            logger.debug("SIGTERM has a handler of its own; no stop notice")
            return False
        notice = _Notice()
        try:
            previous = signal.set_wakeup_fd(notice.writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError) as exc:
            logger.debug("no stop notice: %s", exc)
            notice.reader.close()
            notice.writer.close()
            return False
        if previous != -1:  # an event loop's: leave it alone
            signal.set_wakeup_fd(previous)
            notice.reader.close()
            notice.writer.close()
            return False
        signal.signal(signal.SIGTERM, notice.on_sigterm)
        notice.set_targets({id(owner): (run_dir, rank)})
        notice.thread.start()
        _installed = notice
        return True


def uninstall(owner: object) -> None:
    """Unregister ``owner``; the last one out puts the previous handler and wakeup fd back (from
    the main thread; elsewhere the notice stays, harmless, until the process ends)."""
    global _installed
    with _install_lock:
        notice = _installed
        if notice is None:
            return
        notice.set_targets({k: v for k, v in notice.targets.items() if k != id(owner)})
        if notice.targets or notice.started:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == notice.on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(ValueError, OSError):
            current = signal.set_wakeup_fd(-1)  # install() only proceeds where none was set
            if current != notice.writer.fileno():  # set by someone else since: theirs stays
                signal.set_wakeup_fd(current)
        notice.writer.close()
        notice.reader.close()  # the thread's recv ends
        _installed = None
