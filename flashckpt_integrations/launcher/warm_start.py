"""Warm worker starts: restarted workers are forked from an interpreter that has imported torch.

A restart under torch elastic starts every worker as a new interpreter, which imports torch (and
the script's other heavy modules) again: on this project's test machine 1.2-1.8 s of each
restart, and tens of seconds on a cluster node whose Python environment lives on a shared file
system. ``flashckpt-run`` instead keeps one *template* process per node: it imports torch and
this package once, at launch, and then forks each worker on request. A fork costs a few
milliseconds and the child shares the template's imported modules copy-on-write.

Call order (all in the launcher, :mod:`.run`):

1. ``WarmStart.launch(preload)`` at launch: starts the template (``python -m`` this module),
   which imports ``preload`` and says it is ready. Nothing in it touches an accelerator, so a
   forked worker initialises CUDA (or any other device) itself, as a fresh interpreter would.
2. ``with warm.installed():`` around torch elastic's ``_start_workers``: its process handlers
   ask :meth:`WarmStart.spawn` for each worker whose command is this interpreter running a
   script (``python -u train.py ...``) or a module (``python -u -m pkg ...``), the shape torchrun
   builds; anything else (``--no-python``, a NUMA-wrapped command, a template that is not
   ready or is gone) is started by torch as usual.
3. The template forks; the child makes its own session (torch elastic signals the process
   group), takes the worker's environment, working directory, ``sys.argv``, ``sys.path[0]`` and
   output files, resets signal handlers and torch's thread count, runs the script as
   ``__main__`` (``runpy``), then does what an interpreter does at exit (non-daemon threads,
   ``atexit``, flush) and exits with the script's code.
4. The template reaps its children and reports each exit status; the launcher's stand-in for
   ``Popen`` (:class:`_ForkedProcess`) answers torch elastic's ``poll``/``wait`` from it.
5. ``warm.close()`` when the launcher exits. If the template dies, its workers are treated as
   failed (torch elastic restarts them, then without the template).

``FLASHCKPT_WARM_START=0`` or ``flashckpt-run --no-warm-start`` turns it off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "flashckpt_integrations")
READY_TIMEOUT_S = 120.0
_CMDLINE_ROOM = 4096


class _ForkedProcess:
    """What torch elastic uses of a ``Popen``, for a worker forked by the template."""

    def __init__(self, pid: int, warm: WarmStart) -> None:
        self.pid = pid
        self.args: Sequence[str] = ()
        self._warm = warm

    @property
    def returncode(self) -> int | None:
        return self._warm.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._warm.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(list(self.args), timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStart:
    """The launcher's side of the template process (see the module docstring for the order)."""

    def __init__(self, proc: subprocess.Popen, requests: Any, statuses: Any) -> None:
        self._proc = proc
        self._requests = requests  # file object: one JSON line per worker to fork
        self._statuses = statuses  # file object: "ready", then {"pid"}/{"exit"} lines
        self._lock = threading.Condition()
        self._ready = False
        self._gone = False
        self._answers: list[dict[str, Any]] = []
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._reader = threading.Thread(target=self._read, name="flashckpt-warm-start", daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, preload: Sequence[str] = DEFAULT_PRELOAD) -> WarmStart | None:
        """Start the template; ``None`` (and the reason in the log) where it cannot start."""
        try:
            req_r, req_w = os.pipe()
            st_r, st_w = os.pipe()
            proc = subprocess.Popen(
                # -u: as workers; the padding is room for each worker's command line (see _show_command)
                [sys.executable, "-u", "-m", __name__, str(req_r), str(st_w), ",".join(preload), " " * _CMDLINE_ROOM],
                pass_fds=(req_r, st_w), stdin=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:
            logger.info("warm worker starts are off: the template process did not start: %s", exc)
            return None
        os.close(req_r)
        os.close(st_w)
        return cls(proc, os.fdopen(req_w, "w", buffering=1), os.fdopen(st_r, "r"))

    def _read(self) -> None:
        for line in self._statuses:
            message = json.loads(line)
            with self._lock:
                if message.get("ready"):
                    self._ready = True
                elif "exit" in message:
                    self._exits[int(message["pid"])] = int(message["exit"])
                else:
                    self._answers.append(message)
                self._lock.notify_all()
        with self._lock:
            self._gone = True
            for pid in self._children - set(self._exits):  # orphans of a dead template: end them
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self._exits[pid] = -signal.SIGKILL
            self._lock.notify_all()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        with self._lock:
            self._lock.wait_for(lambda: self._ready or self._gone, timeout)
            return self._ready and not self._gone

    def spawn(self, entrypoint: str, args: Sequence[str], env: dict[str, str],
              stdout: str | None, stderr: str | None) -> _ForkedProcess | None:
        """Fork a worker for ``entrypoint args`` (torchrun's command shape), or ``None``: start it
        the usual way (another command, or no template)."""
        target = python_target(entrypoint, args)
        if target is None or not self.wait_ready():
            return None
        request = {"target": target, "command": [entrypoint, *map(str, args)], "env": env, "cwd": os.getcwd(),
                   "stdout": stdout, "stderr": stderr}
        with self._lock:
            if self._gone:
                return None
            try:
                self._requests.write(json.dumps(request) + "\n")
            except (OSError, ValueError):
                return None
            self._lock.wait_for(lambda: self._answers or self._gone, 30)
            if not self._answers:
                return None
            answer = self._answers.pop(0)
            if "pid" not in answer:
                logger.warning("the template could not fork a worker (%s); starting it anew", answer.get("error"))
                return None
            pid = int(answer["pid"])
            self._children.add(pid)
        process = _ForkedProcess(pid, self)
        process.args = (entrypoint, *args)
        return process

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._requests.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Let torch elastic's worker starts (inside this block) go through :meth:`spawn`."""
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        original = getattr(api, "get_subprocess_handler", None)
        if original is None:  # another torch release: workers start as usual
            yield
            return
        warm = self

        class _WarmHandler(SubprocessHandler):
            def __init__(self, *, stdout: str | None, stderr: str | None, **kwargs: Any) -> None:
                self._paths = (stdout, stderr)
                super().__init__(stdout=stdout, stderr=stderr, **kwargs)

            def _popen(self, args: tuple, env: dict[str, str]) -> Any:
                forked = warm.spawn(args[0], args[1:], env, *self._paths) if args else None
                return forked if forked is not None else super()._popen(args, env)

            def close(self, *args: Any, **kwargs: Any) -> None:
                # a forked worker's exit reaches us from the template: one that died and was reaped
                # there a moment before is polled as running, and its process group is gone
                with contextlib.suppress(ProcessLookupError):
                    super().close(*args, **kwargs)

        def handler(**kwargs: Any) -> SubprocessHandler:
            return _WarmHandler(**kwargs)

        api.get_subprocess_handler = handler
        try:
            yield
        finally:
            api.get_subprocess_handler = original


def python_target(entrypoint: str, args: Sequence[str]) -> dict[str, Any] | None:
    """``{"script"|"module", "argv"}`` for ``python -u [-m] target args``; else ``None``."""
    try:
        same = os.path.samefile(entrypoint, sys.executable)
    except OSError:
        same = False
    args = [str(a) for a in args]
    if not same or len(args) < 2 or args[0] != "-u":
        return None
    if args[1] == "-m":
        if len(args) < 3:
            return None
        return {"module": args[2], "argv": args[3:]}
    if args[1].startswith("-") or not os.path.isfile(args[1]):
        return None
    return {"script": os.path.abspath(args[1]), "argv": args[2:]}


# --- the template process ---------------------------------------------------------------------


def _template(request_fd: int, status_fd: int, preload: Sequence[str]) -> int:
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a worker that needs it imports it itself (and reports the error)
            print(f"flashckpt-run: warm start could not preload {name}: {exc}", file=sys.stderr)
    status = os.fdopen(status_fd, "w", buffering=1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the launcher ends the template by closing its pipe
    status.write(json.dumps({"ready": True}) + "\n")
    children: set[int] = set()
    pending = b""
    open_ = True
    while open_ or children:
        readable, _, _ = select.select([request_fd, wake_r] if open_ else [wake_r], [], [], 1.0)
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if request_fd in readable:
            chunk = os.read(request_fd, 1 << 20)
            open_ = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = _fork_worker(json.loads(line), (request_fd, status_fd, wake_r, wake_w))
                if pid is None:
                    status.write(json.dumps({"error": "fork failed"}) + "\n")
                    continue
                children.add(pid)
                status.write(json.dumps({"pid": pid}) + "\n")
        while children:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            status.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(code)}) + "\n")
    return 0


def _fork_worker(request: dict[str, Any], inherited: Sequence[int]) -> int | None:
    """Fork; the child becomes the worker. Returns once the child leads its own session (so that
    torch elastic can signal its process group at once)."""
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(ready_r)
        os.close(ready_w)
        return None
    if pid == 0:
        os.close(ready_r)
        _become_worker(request, (*inherited, ready_w))  # never returns
    os.close(ready_w)
    with contextlib.suppress(OSError):
        os.read(ready_r, 1)  # the child's byte after setsid(), or EOF if it died first
    os.close(ready_r)
    return pid


def _become_worker(request: dict[str, Any], inherited: Sequence[int]) -> None:
    """In the forked child: turn into the worker the request describes, run it, exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()  # torch elastic ends a worker by signalling its process group
        *others, ready = inherited
        os.write(ready, b"1")
        for fd in (*others, ready):
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd, path in ((1, request.get("stdout")), (2, request.get("stderr"))):
            if path:
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(out, fd)
                os.close(out)
        _show_command(request["command"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        code = _run(request["target"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        code = _finalize(code)
        os._exit(code)


def _show_command(command: Sequence[str]) -> None:
    """Make ``/proc/<pid>/cmdline`` (``ps``, ``pgrep -f``) show the worker's command, not the
    template's: it is rewritten in place, in the template's argument area (padded for it)."""
    import ctypes

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5) fields 48, 49)
        data = "\0".join(command).encode()[: end - start - 1]
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    except (OSError, ValueError, IndexError):
        pass  # only what ps shows


def _run(target: dict[str, Any]) -> int:
    """Run the script or module as ``__main__`` (its exceptions go to :func:`_become_worker`)."""
    import runpy

    if "module" in target:
        sys.argv = [target["module"], *target["argv"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(target["module"], run_name="__main__", alter_sys=True)
    else:
        script = target["script"]
        sys.argv = [script, *target["argv"]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _finalize(code: int) -> int:
    """What the interpreter does at exit: join non-daemon threads, run atexit, flush."""
    import atexit

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    try:
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code & 0xFF if code >= 0 else 1


def _main(argv: Sequence[str]) -> int:
    request_fd, status_fd = int(argv[0]), int(argv[1])
    preload = [m for m in (argv[2] if len(argv) > 2 else "").split(",") if m.strip()]
    return _template(request_fd, status_fd, preload)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
