"""``flashckpt-run``: torchrun that takes care of flash checkpoints.

    flashckpt-run [--checkpoint-dir DIR [--job-id ID]] [--auto-config] [--node-check]
                  [torchrun options] train.py [script args]

It accepts every torchrun option (torch.distributed.run's own parser and ``config_from_args``)
and runs the workers under torch elastic's ``LocalElasticAgent``: its rendezvous, its restarts.
On top of that, per node:

- With ``--checkpoint-dir`` (the directory the script gives its ``Checkpointer``; add
  ``--job-id`` when the script sets a job id) the launcher starts the node's saver before the
  first workers, watching the launcher's pid, so the saver and the shared memory outlive every
  worker.
- When a worker fails it prints that rank's error with host and rank: the exception and its
  traceback (from torch elastic's error file when the script uses ``@record``, else from the
  rank's stderr, which the launcher tees to a log unless ``--tee``/``--redirects`` say
  otherwise), or the signal and exit code. Then it restarts the workers (up to
  ``--max-restarts``), which resume from memory, and beside the restart, on a thread of its own,
  persists the newest step that every local rank holds complete in memory, if that step is newer
  than the last commit: the restart does not wait for the write. The saver's per-slot lock keeps
  the restarted workers' saves off a slot while it is being written; a persist that finds its
  snapshot replaced meanwhile says so and writes nothing.
- On SIGTERM/SIGINT (torchrun's ``--signals-to-handle``) it stops the workers, persists the same
  way, waits for in-flight persisting and exits with 128 + the signal number.
- Before it exits it waits (``--drain-timeout``) for the saver's in-flight persists and commits.
- With a node's switch (``--topology-switch``, ``--topology-file`` or ``--topology-key``) the c10d
  rendezvous orders node ranks by switch (:mod:`.topology`). A node whose node check fails, or
  whose workers die of SIGBUS ``--node-failure-threshold`` times, leaves the rendezvous, is
  reported by the ``--node-failure-handler`` (``kubernetes`` cordons it) and exits with 138
  (:mod:`.node_failure`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from .. import knobs
from .._utils.help import HelpFormatter, plain_text
from ..core.client import SaverClient, job_id_for, job_key, run_dir_for
from ..core.protocol import LOG_NAME
from ..core.rescue import RescueStatus, in_flight, job_slots, persist_newest
from ..errors import FlashCkptError, NodeCheckError
from . import node_failure, topology, warm_start

logger = logging.getLogger(__name__)

PROG = "flashckpt-run"
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_OWN_OPTIONS = {  # flag -> takes a value; removed from the argv handed to --auto-config
    "--checkpoint-dir": True, "--job-id": True, "--auto-config": False, "--node-check": False,
    "--node-check-timeout": True, "--node-check-report": True, "--commit-timeout": True, "--drain-timeout": True,
    "--node-name": True, "--topology-switch": True, "--topology-file": True, "--topology-key": True,
    "--node-failure-handler": True, "--node-failure-threshold": True, "--no-warm-start": False,
    "--warm-start-preload": True,
}


def _say(message: str, stream: IO[str] | None = None) -> None:
    print(f"{PROG}: {message}", file=stream or sys.stderr, flush=True)


# --- arguments ------------------------------------------------------------------------------


_USAGE = f"{PROG} [{PROG} options] [torchrun options] training_script [training_script_args ...]"
_DESCRIPTION = """\
torchrun that takes care of flash checkpoints: it runs the workers under torch elastic's agent
(its rendezvous, its restarts) and, with --checkpoint-dir, hosts the node's saver, prints a failed
rank's error, persists the newest step held in memory when a worker fails or the job is stopped,
and waits for in-flight persisting before it exits. Its own options come first; every torchrun
option is accepted too (listed after them, as torchrun --help describes them)."""
OWN_GROUP = f"{PROG} options"
TORCHRUN_GROUP = "torchrun options"
_MISSING_HELP = {"training_script_args": "the training script's own arguments, passed to it as they are"}


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser plus this launcher's options (listed first in ``--help``)."""
    parser = get_args_parser()
    parser.prog = PROG
    parser.usage = _USAGE
    parser.description = _DESCRIPTION
    parser.formatter_class = HelpFormatter
    for action in parser._actions:  # torchrun's help is written in reST
        action.help = plain_text(action.help) or _MISSING_HELP.get(action.dest)
    parser._optionals.title = TORCHRUN_GROUP
    group = parser.add_argument_group(OWN_GROUP)
    group.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="the directory (or URL) the script's Checkpointer saves to: the launcher hosts "
                       "that job's saver and persists its newest in-memory step on failure or stop "
                       "(default: none, nothing is persisted from memory)")
    group.add_argument("--job-id", default=None, metavar="ID",
                       help="the script's job id, when it sets one (CheckpointerConfig.job_id or "
                       f"${knobs.JOB_ID}) (default: named by --checkpoint-dir)")
    group.add_argument("--auto-config", action="store_true",
                       help="fill in --nnodes/--nproc-per-node/--node-rank/--master-addr/--master-port "
                       "from the environment where they are not given")
    group.add_argument("--node-check", action="store_true", help="check this node before starting the workers")
    group.add_argument("--node-check-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long the node check may take")
    group.add_argument("--node-check-report", default=None, metavar="PATH",
                       help="keep this node's node-check report (JSON) at PATH (default: not kept)")
    group.add_argument("--commit-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="when persisting after a failure or stop, how long rank 0's node waits for the "
                       "other nodes' files")
    group.add_argument("--drain-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long to wait for in-flight persisting before exiting")
    group.add_argument("--no-warm-start", action="store_true",
                       help="start every worker as a new interpreter (default: workers, restarted ones included, are "
                       "forked from a process that imported torch, this package and --warm-start-preload once at "
                       f"launch; ${knobs.WARM_START}=0 turns it off too)")
    group.add_argument("--warm-start-preload", default="", metavar="MODULES",
                       help="comma-separated modules that process imports besides torch and this package (e.g. "
                       "transformers), so that restarted workers do not import them again")
    _add_cluster_options(group)
    parser._action_groups.sort(key=lambda g: g.title != OWN_GROUP)  # stable: then torchrun's, as they were
    return parser


def _add_cluster_options(group: argparse._ArgumentGroup) -> None:
    """Node ranks by switch (topology.py) and faulty nodes leaving the job (node_failure.py)."""
    group.add_argument("--node-name", default=None, metavar="NAME",
                       help="this node's name, as the topology file and the Kubernetes API know it (default: "
                       f"${topology.NODE_NAME_ENV}, else the host name)")
    group.add_argument("--topology-switch", default=None, metavar="SWITCH",
                       help="the network switch this node hangs off: node ranks are grouped by switch (switches "
                       "by name, nodes by name inside), on the c10d rendezvous (default: "
                       f"${topology.SWITCH_ENV}; without any --topology-* option ranks are torch's)")
    group.add_argument("--topology-file", default=None, metavar="PATH",
                       help="a file mapping node names to switches: 'node switch' lines, a JSON object, or a Slurm "
                       f"topology.conf (default: ${topology.FILE_ENV})")
    group.add_argument("--topology-key", default=None, metavar="LABEL",
                       help="the Kubernetes node label that names this node's switch, read from the API (default: "
                       f"${topology.KEY_ENV})")
    group.add_argument("--node-failure-handler", default=None, metavar="NAME",
                       help="what to do with this node when its node check fails or its workers die of SIGBUS (or "
                       "of what a classifier plugin puts down to the node) --node-failure-threshold times: log, "
                       "kubernetes (cordon the node), or a plugin's; then the launcher leaves the rendezvous and "
                       f"exits with {node_failure.NODE_FAILURE_EXIT_CODE} (default: ${node_failure.HANDLER_ENV}, "
                       "else log)")
    group.add_argument("--node-failure-threshold", type=int, default=node_failure.DEFAULT_THRESHOLD, metavar="N",
                       help="worker failures that point at the node before it leaves the job")


def _restart_notice(max_restarts: int) -> str:
    """What a launch without --checkpoint-dir does on a failure (said once, at the start)."""
    restarts = (f"failed workers are restarted (up to {max_restarts} times)" if max_restarts > 0
                else "restarts are off (--max-restarts 0)")
    return f"no --checkpoint-dir: {restarts}, and nothing is persisted from memory on failure or stop"


def _after_failure(left: int, most: int) -> str:
    if most <= 0:
        return "restarts are off (--max-restarts 0): not restarting the workers"
    if left > 0:
        return f"restarting the workers (restart {most - left + 1} of {most})"
    return f"no restarts left (--max-restarts {most})"


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.auto_config:
        try:
            from .auto_config import auto_config_args
        except ImportError as exc:
            parser.error(f"--auto-config is not available in this installation: {exc}")
        own = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag in _OWN_OPTIONS}
        try:
            filled = auto_config_args(torchrun_argv(list(argv), args), env if env is not None else os.environ)
        except ValueError as exc:
            parser.error(f"--auto-config: {exc}")
        _say(f"auto-config: torchrun {' '.join(filled)}")
        args = parser.parse_args(filled)
        for dest, value in own.items():
            setattr(args, dest, value)
    return args


def torchrun_argv(argv: list[str], args: argparse.Namespace) -> list[str]:
    """``argv`` without this launcher's own options (the script's arguments are left alone)."""
    split = len(argv) - 1 - len(args.training_script_args)  # argparse keeps the script's part verbatim
    head, tail = argv[:split], argv[split:]
    kept, i = [], 0
    while i < len(head):
        name = head[i].split("=", 1)[0]
        if name in _OWN_OPTIONS:
            i += 1 + (_OWN_OPTIONS[name] and "=" not in head[i])
            continue
        kept.append(head[i])
        i += 1
    return kept + tail


def _resolve_rendezvous(args: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` does before it builds the launch config."""
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.tee == "0" and args.redirects == "0":
        args.tee = "2"  # keep each rank's stderr in a log too, to show a failing rank's traceback


# --- the node's flash-checkpoint care -------------------------------------------------------


class NodeCare:
    """Hosts the node's saver, reports failed ranks, persists from memory, drains at exit."""

    def __init__(self, checkpoint_dir: str | None, job_id: str | None, *, commit_timeout: float,
                 drain_timeout: float) -> None:
        if checkpoint_dir is not None and "://" not in checkpoint_dir:
            checkpoint_dir = os.path.abspath(os.path.expanduser(checkpoint_dir))
        self.checkpoint_dir = checkpoint_dir
        self.job = job_id_for(checkpoint_dir, job_id)
        self.commit_timeout = commit_timeout
        self.drain_timeout = drain_timeout
        self.host = socket.gethostname()
        self.group_rank = 0
        self._client: _LauncherClient | None = None
        self._beside: ThreadPoolExecutor | None = None  # the persist after a failure, beside the restart

    def before_workers(self, group_rank: int) -> None:
        """Start (or find) the node's saver before the workers, so it outlives them."""
        self.group_rank = group_rank
        if self.job is None:
            return
        node = knobs.get(knobs.NODE_ID) or f"{self.host}-{group_rank}"  # as the ranks name it
        client = self._client
        try:
            run_dir = run_dir_for(job_key(self.job), job_key(node)[:8])
            if client is not None and client.connected and client.run_dir == run_dir:
                return
            if client is not None:
                client.close(clean=False)
            self._client = _LauncherClient(run_dir, rank=-1)
            self._client.connect()
            _say(f"saver pid {self._client.saver_pid} serves job {self.job} on {self.host}")
        except FlashCkptError as exc:  # the workers start one themselves
            _say(f"could not start the node's saver ({exc}); the workers will start it")
            self._client = None

    def on_failure(self, failures: Mapping[int, ProcessFailure], stderrs: Mapping[int, str]) -> None:
        try:
            report_failures(failures, stderrs, self.host, self.group_rank)
        except Exception as exc:  # never let reporting stop the restart
            _say(f"could not report the failed workers: {type(exc).__name__}: {exc}")
        if self.job is not None:
            if self._beside is None:
                self._beside = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-run-persist")
            self._beside.submit(self.persist, "a worker failed")
        else:
            self.persist("a worker failed")

    def wait_for_persist(self) -> None:
        """Wait for the persist after a failure (the next stop, failure or exit comes after it)."""
        if self._beside is not None:
            self._beside.shutdown(wait=True)
            self._beside = None

    def persist(self, why: str) -> None:
        """Persist and commit the newest step every local rank holds in memory, if newer than storage."""
        if self.job is None:
            _say(f"{why}; without --checkpoint-dir nothing is persisted from memory")
            return
        slots = self._slots()
        if not slots:
            _say(f"{why}; no shared memory of job {self.job} on {self.host}: nothing to persist")
            return
        started = time.monotonic()
        try:
            result = persist_newest(slots, commit_timeout=self.commit_timeout)
        except Exception as exc:  # the launcher carries on (restart or exit) and says why
            _say(f"{why}; persisting from memory failed: {type(exc).__name__}: {exc}")
            return
        if result.status in (RescueStatus.COMMITTED, RescueStatus.PERSISTED):
            _say(f"{why}; step {result.step} persisted from memory ({result.status.value}, "
                 f"{result.bytes_written / 2**20:.1f} MiB in {time.monotonic() - started:.1f}s)")
        else:
            _say(f"{why}; {result.status.value}: {result.reason}")

    def drain(self) -> None:
        """Wait (bounded) for the saver's in-flight persists and commits, then leave it."""
        self.wait_for_persist()
        if self.job is not None:
            deadline = time.monotonic() + self.drain_timeout
            pending = self._in_flight()
            if pending:
                _say(f"waiting for in-flight persisting: {'; '.join(pending)}")
            while pending and time.monotonic() < deadline:
                time.sleep(0.2)
                pending = self._in_flight()
            if pending:
                _say(f"gave up waiting after {self.drain_timeout:.0f}s: {'; '.join(pending)}")
        if self._client is not None:
            self._client.close(clean=True)
            self._client = None

    def _slots(self) -> dict[int, list[str]]:
        return job_slots(self.checkpoint_dir or "", self.job)

    def _in_flight(self) -> list[str]:
        try:
            return in_flight(self._slots())
        except Exception as exc:  # e.g. storage unreachable: nothing to wait for that can be seen
            _say(f"cannot tell what is still being persisted: {type(exc).__name__}: {exc}")
            return []


class _LauncherClient(SaverClient):
    """The launcher's link to the node's saver; a saver it starts watches the launcher's pid."""

    def _start_saver(self) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        with open(os.path.join(self.run_dir, LOG_NAME), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashckpt_integrations.core.saver", "--run-dir", self.run_dir,
                 "--watch-pid", str(os.getpid()), "--idle-exit", knobs.get(knobs.SAVER_IDLE_EXIT, "300")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                start_new_session=True, env=env, cwd="/",
            )
        logger.info("started saver pid %d for %s", proc.pid, self.run_dir)


# --- reporting failures ---------------------------------------------------------------------


def report_failures(failures: Mapping[int, ProcessFailure], stderrs: Mapping[int, str], host: str,
                    group_rank: int, stream: IO[str] | None = None) -> None:
    """Print each failed rank's error: exception and traceback, or signal and exit code."""
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    causes = sorted(set(failures) - stopped) or sorted(failures)
    for rank in causes:
        failure = failures[rank]
        _say(f"rank {rank} failed on host {host} (node rank {group_rank}, local rank {failure.local_rank}, "
             f"pid {failure.pid}): {_how(failure)}", stream)
        for line in _error_text(failure, stderrs.get(failure.local_rank, "")).splitlines():
            print(f"    {line}", file=stream or sys.stderr)
    others = sorted(set(failures) - set(causes))
    if others:
        _say(f"ranks {others} on host {host} were stopped by the launcher after that", stream)
    (stream or sys.stderr).flush()


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
    return f"exit code {failure.exitcode}"


def _error_text(failure: ProcessFailure, stderr_path: str) -> str:
    """The traceback from the rank's error file (``@record``), else from its stderr log."""
    message = failure.message
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack")
        return stack or str(message.get("message", ""))
    if failure.error_file and os.path.isfile(failure.error_file) and message:
        return str(message)
    return _stderr_tail(stderr_path)


def _stderr_tail(path: str, max_lines: int = 60) -> str:
    """The last traceback in a stderr log (or its last lines); empty when there is no log."""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - (1 << 16)))
        text = f.read().decode(errors="replace")
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]  # torch prefixes "[rank1]: "
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    tail = lines[starts[-1]:] if starts else lines[-10:]
    return "\n".join(tail[-max_lines:])


# --- the agent ------------------------------------------------------------------------------


class FlashElasticAgent(LocalElasticAgent):
    """torch elastic's local agent, with the node's care run around worker starts and failures."""

    def __init__(self, *args: Any, care: NodeCare, monitor: node_failure.NodeFailureMonitor | None = None,
                 warm: warm_start.WarmStart | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._care = care
        self._monitor = monitor
        self._warm = warm
        self.node_failure: node_failure.NodeFailure | None = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._care.before_workers(worker_group.group_rank or 0)
        order = getattr(worker_group.spec.rdzv_handler, "last_order", None)
        if order is not None:
            _say(f"node ranks by switch, {order}")
        if self._warm is None:
            return super()._start_workers(worker_group)
        with self._warm.installed():  # forked from the warm template where the command allows it
            return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            # Every worker of the node is stopped by now (torch elastic closes them on a failure).
            stderrs = dict(self._pcontext.stderrs) if self._pcontext is not None else {}
            self._care.on_failure(result.failures, stderrs)
            if self._monitor is not None:
                self.node_failure = self._monitor.workers_failed(
                    result.failures, lambda f: _error_text(f, stderrs.get(f.local_rank, "")))
            if self.node_failure is not None:
                self._remaining_restarts = 0  # this node leaves the job: see launch()
                _say(f"{self.node_failure}; this node leaves the job")
            else:
                _say(_after_failure(self._remaining_restarts, worker_group.spec.max_restarts))
        return result


def _accepted(callable_: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that ``callable_`` takes (torch adds fields between releases)."""
    params = inspect.signature(callable_).parameters
    return {k: v for k, v in values.items() if k in params}


def launch(config: LaunchConfig, entrypoint: Any, args: Sequence[Any], care: NodeCare,
           monitor: node_failure.NodeFailureMonitor | None = None, warm: warm_start.WarmStart | None = None) -> int:
    """Run the workers under the agent (as ``torch.distributed.launcher.api.launch_agent`` does)."""
    config.run_id = config.run_id or str(uuid.uuid4().int)
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ[knobs.STOP_NOTICE] = "0"  # its workers die at SIGTERM: this launcher persists on SIGTERM itself
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = getattr(config, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values.update(local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
                  rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
                  master_addr=master_addr, master_port=master_port)
    spec = WorkerSpec(**_accepted(WorkerSpec, values))
    agent = FlashElasticAgent(care=care, monitor=monitor, warm=warm,
                              **_accepted(LocalElasticAgent, {**values, "spec": spec}))
    shutdown_rdzv = True
    try:
        result = agent.run()
        if agent.node_failure is not None and monitor is not None:
            shutdown_rdzv = False  # closing it would stop the other nodes too
            node_failure.leave_rendezvous(spec.rdzv_handler)
            return _report_node_failure(monitor, agent.node_failure)
        return 1 if result.is_failed() else 0
    except SignalException as exc:  # the agent has stopped the workers
        shutdown_rdzv = False  # as torch does: the rendezvous stays open for the other nodes
        care.wait_for_persist()
        care.persist(f"stopped by {exc.sigval.name}")
        return 128 + int(exc.sigval)
    finally:
        if shutdown_rdzv:
            with contextlib.suppress(Exception):
                spec.rdzv_handler.shutdown()
        care.drain()


def _report_node_failure(monitor: node_failure.NodeFailureMonitor, failure: node_failure.NodeFailure) -> int:
    code, done = monitor.report(failure)
    _say(f"{failure.node}: {done}; exiting with {code}")
    return code


def _node_check(config: LaunchConfig, timeout_s: float, report_path: str | None = None) -> NodeCheckError | bool:
    """True when the check passed; else False, or the NodeCheckError that says which nodes failed."""
    try:
        from .node_check import run_node_check
    except ImportError as exc:
        _say(f"--node-check is not available in this installation: {exc}")
        return False
    try:
        run_node_check(config, timeout_s, report_path=report_path)  # it reports what it found
    except NodeCheckError as exc:
        if isinstance(exc.__cause__, RendezvousClosedError) and config.max_nodes > 1:
            # A node that replaces one that left: the others checked and went on to training.
            _say("the other nodes' node check is over (its rendezvous is closed): checking this node alone")
            alone = dataclasses.replace(config, min_nodes=1, max_nodes=1, rdzv_backend="c10d",
                                        rdzv_endpoint="localhost:0", rdzv_configs={}, run_id=str(uuid.uuid4()))
            return _node_check(alone, timeout_s, report_path)
        _say(f"node check failed on {socket.gethostname()}: {exc}")
        return exc
    return True


def _after_node_check(error: NodeCheckError | bool, config: LaunchConfig,
                      monitor: node_failure.NodeFailureMonitor) -> int | None:
    """None to go on to training, else the exit code: this node is the faulty one, or no verdict."""
    verdict = node_failure.judge_node_check(error) if isinstance(error, NodeCheckError) else None
    if verdict is node_failure.CheckVerdict.THIS_NODE:
        failure = monitor.node_check_failed(error)
        _say(f"{failure}; this node leaves the job")
        return _report_node_failure(monitor, failure)
    if verdict is node_failure.CheckVerdict.OTHER_NODES:
        total, left = node_failure.nodes_left(error)
        if left >= config.min_nodes or monitor.handler.rescheduled:
            _say(f"the node check named other nodes only: going on with {left} of {total} nodes, "
                 "the named ones leave the job")
            return None
        _say(f"the node check named other nodes, and the {left} nodes left are fewer than --nnodes' minimum "
             f"{config.min_nodes}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _resolve_rendezvous(args)
    # With the agent's TCP store shared across restarts, restarted workers can read the previous
    # attempt's keys and fail to connect (pytorch/pytorch#135712): a fresh store per attempt.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config, entrypoint, cmd_args = config_from_args(args)
    try:
        topology.configure(config, node=args.node_name, switch=args.topology_switch, topology_file=args.topology_file,
                           topology_key=args.topology_key)
        monitor = node_failure.NodeFailureMonitor(node_failure.select_node_failure_handler(args.node_failure_handler),
                                                  topology.node_name(args.node_name),
                                                  threshold=args.node_failure_threshold)
        monitor.handler.prepare(monitor.node)
    except (ValueError, FlashCkptError) as exc:
        _say(str(exc))
        return 2
    if args.node_check:
        checked = _node_check(config, args.node_check_timeout, args.node_check_report)
        if checked is not True and (code := _after_node_check(checked, config, monitor)) is not None:
            return code
    if args.checkpoint_dir is None and args.job_id is None and knobs.get(knobs.JOB_ID) is None:
        _say(_restart_notice(config.max_restarts))
    care = NodeCare(args.checkpoint_dir, args.job_id, commit_timeout=args.commit_timeout,
                    drain_timeout=args.drain_timeout)
    warm = None
    if (not args.no_warm_start and knobs.get(knobs.WARM_START, "1") != "0"
            and warm_start.python_target(entrypoint, cmd_args) is not None):  # else no worker could use it
        extra = [m.strip() for m in args.warm_start_preload.split(",") if m.strip()]
        warm = warm_start.WarmStart.launch((*warm_start.DEFAULT_PRELOAD, *extra))
    try:
        return launch(config, entrypoint, cmd_args, care, monitor, warm)
    finally:
        if warm is not None:
            warm.close()


if __name__ == "__main__":
    sys.exit(main())
