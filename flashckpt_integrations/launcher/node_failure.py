"""Faulty nodes taken out of the job and, on Kubernetes, out of scheduling.

A node is faulty when its own node check names it, or when its workers fail
``--node-failure-threshold`` times (default 2) in a way that a classifier puts down to the node.
The built-in classifier counts a worker killed by SIGBUS (how the kernel reports memory it cannot
read, such as an uncorrectable ECC error), unless ``/dev/shm`` is full, which is the job's doing.
A worker that exits with a code of its own, a Python exception included, never counts: a plain
software error in the script never takes a node out.

Call order, in each node's launcher:

1. :func:`select_node_failure_handler` picks the handler by name (``--node-failure-handler``), and
   ``handler.prepare(node)`` runs before anything starts, so that a handler that cannot work (no
   credentials, a node name the cluster does not know) says so at the start, not when a node fails.
2. :class:`NodeFailureMonitor` judges what it is shown:

   - after a failed node check, :func:`judge_node_check` tells whether the check named this node
     (then :meth:`NodeFailureMonitor.node_check_failed` gives the :class:`NodeFailure`), named only
     other nodes (this node goes on to training, without them), or cannot tell (the launcher fails
     as before);
   - after each failed worker group, :meth:`NodeFailureMonitor.workers_failed` returns the
     :class:`NodeFailure` once classified failures reach the threshold, else ``None`` (the launcher
     restarts the workers as usual).
3. With a :class:`NodeFailure` the launcher stops its workers and calls :func:`leave_rendezvous`,
   so the other nodes carry on (``--nnodes MIN:MAX``) without waiting for this node's heartbeat to
   expire, then :meth:`NodeFailureMonitor.report`, which runs ``handler.handle(failure)`` and
   returns :data:`NODE_FAILURE_EXIT_CODE`, the launcher's exit code.

Handlers (:class:`NodeFailureHandler`) and classifiers (``(WorkerFailure) -> reason or None``) are
plugins, registered with :func:`register_node_failure_handler` and
:func:`register_node_failure_classifier` or through the entry-point groups
``flashckpt_integrations.node_failure_handlers`` and
``flashckpt_integrations.node_failure_classifiers``. Built-in handlers: ``log`` (the default: say
so, nothing else) and ``kubernetes`` (cordon the Node the pod runs on, through the official
``kubernetes`` client with in-cluster credentials or a kubeconfig).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import enum
import functools
import importlib.metadata
import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import FlashCkptError, NodeCheckError, missing_dependency

logger = logging.getLogger(__name__)

NODE_FAILURE_EXIT_CODE = 138
"""The launcher's exit code once it found its node faulty and left the job. Kubeflow's
training-operator treats it as retryable under ``restartPolicy: ExitCode`` (128 + SIGUSR1, the code
its older releases reserve for "retry me"; newer ones retry every code from 128), so the operator
recreates the pod, and the scheduler places it off the cordoned node. For a batch Job (Trainer v2
TrainJob, JobSet) a ``podFailurePolicy`` rule ``action: Ignore`` on this code does the same."""
DEFAULT_THRESHOLD = 2
HANDLER_ENV = "FLASHCKPT_NODE_FAILURE_HANDLER"
HANDLER_GROUP = "flashckpt_integrations.node_failure_handlers"
CLASSIFIER_GROUP = "flashckpt_integrations.node_failure_classifiers"
LABEL_PREFIX = "flashckpt.io"
REASON_LABEL = f"{LABEL_PREFIX}/cordon-reason"
TIME_LABEL = f"{LABEL_PREFIX}/cordoned-at"
DETAIL_ANNOTATION = f"{LABEL_PREFIX}/cordon-detail"
SHM_DIR = "/dev/shm"
SHM_FULL_FRACTION = 0.02
"""Less than this fraction of ``/dev/shm`` free at a SIGBUS: the job filled it, the node is fine."""


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """One failed worker, as a classifier sees it."""

    rank: int
    local_rank: int
    exitcode: int
    """The exit code, or minus the signal number that killed the worker."""
    signal: str | None
    """``SIGBUS`` and the like when a signal killed the worker."""
    error: str
    """The worker's traceback or the tail of its stderr (may be empty)."""


@dataclasses.dataclass(frozen=True)
class NodeFailure:
    """A node found faulty: what the handler reports."""

    node: str
    reason: str
    """A short word: ``node-check``, ``sigbus``, or a classifier's."""
    detail: str
    time: datetime.datetime = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0))

    def __str__(self) -> str:
        return f"node {self.node} is faulty ({self.reason}): {self.detail}"


NodeFailureClassifier = Callable[[WorkerFailure], "str | None"]
"""Returns the reason when the failure points at the node, else ``None``."""


class NodeFailureHandler(abc.ABC):
    """What happens to a node found faulty, besides the launcher leaving the job.

    Call order, in the node's launcher: ``prepare(node)`` once, before the node check and the
    workers (raise ``ValueError`` or ``FlashCkptError`` saying what to fix when the handler cannot
    work); ``handle(failure)`` at most once, after the node's workers stopped and it left the
    rendezvous; it returns one line saying what it did. Then the launcher exits with
    :data:`NODE_FAILURE_EXIT_CODE`.
    """

    name: ClassVar[str]
    rescheduled: ClassVar[bool] = False
    """Whether the cluster replaces a node that left (a pod rescheduled elsewhere): then the other
    nodes wait for the replacement even when they are fewer than ``--nnodes``'s minimum."""

    def prepare(self, node: str) -> None:  # noqa: B027 (optional hook)
        """Check that :meth:`handle` can work for ``node`` (cheap)."""

    @abc.abstractmethod
    def handle(self, failure: NodeFailure) -> str:
        """Report ``failure``; return what was done, in a few words."""


class LogNodeFailureHandler(NodeFailureHandler):
    """Say so in the log; nothing else (take the node out of service by hand)."""

    name = "log"

    def handle(self, failure: NodeFailure) -> str:
        logger.warning("Node %s is faulty (%s at %s): %s", failure.node, failure.reason,
                       failure.time.isoformat(), failure.detail)
        return "logged only (--node-failure-handler log): take the node out of service by hand"


# --- Kubernetes -----------------------------------------------------------------------------------


def kubernetes_core_api() -> Any:
    """A ``kubernetes.client.CoreV1Api``: from ``$KUBECONFIG`` when it is set, else the pod's
    service account (in-cluster), else ``~/.kube/config``. Built once per process."""
    return _kubernetes_core_api()


@functools.lru_cache(maxsize=1)
def _kubernetes_core_api() -> Any:
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise missing_dependency("kubernetes", "kubernetes") from exc
    configuration = client.Configuration()
    try:
        if not os.environ.get("KUBECONFIG") and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            # the client reads $KUBECONFIG once, at import: pass it as it is now
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                    client_configuration=configuration)
    except config.ConfigException as exc:
        raise ValueError(f"No Kubernetes credentials: {exc}. Run in a pod with a service account (in-cluster), "
                         "or point $KUBECONFIG at a kubeconfig.") from exc
    return client.CoreV1Api(client.ApiClient(configuration))


def _label_value(text: str, limit: int = 63) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:limit].strip("-_.")
    return value or "unknown"


def cordon_patch(failure: NodeFailure, pod: str | None = None) -> dict[str, Any]:
    """The JSON merge patch that cordons the node: ``spec.unschedulable`` (what ``kubectl cordon``
    sets, undone by ``kubectl uncordon``), labels with the reason and time, and an annotation with
    the details."""
    detail = {"reason": failure.reason, "time": failure.time.isoformat(), "detail": failure.detail[:4000]}
    if pod:
        detail["pod"] = pod
    return {
        "spec": {"unschedulable": True},
        "metadata": {
            "labels": {REASON_LABEL: _label_value(failure.reason),
                       TIME_LABEL: failure.time.strftime("%Y%m%dT%H%M%SZ")},
            "annotations": {DETAIL_ANNOTATION: json.dumps(detail)},
        },
    }


def _api_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


class KubernetesNodeFailureHandler(NodeFailureHandler):
    """Cordon the Kubernetes Node this pod runs on (its name: ``$FLASHCKPT_NODE_NAME`` from the
    downward API's ``spec.nodeName``, or ``--node-name``). Needs RBAC ``get`` and ``patch`` on
    ``nodes`` (a ClusterRole) for the pod's service account."""

    name = "kubernetes"
    rescheduled = True
    attempts = 3
    timeout_s = 10.0

    def prepare(self, node: str) -> None:
        api = kubernetes_core_api()
        try:
            api.read_node(node, _request_timeout=self.timeout_s)
        except Exception as exc:
            status = _api_status(exc)
            if status == 404:
                raise ValueError(f"Kubernetes has no node named {node!r}. Set $FLASHCKPT_NODE_NAME from the "
                                 "downward API (fieldRef: spec.nodeName), or pass --node-name.") from exc
            if status in (401, 403):
                raise ValueError(f"Kubernetes refused to show node {node!r} (HTTP {status}); cordoning it would "
                                 "fail too. Give the pod's service account a ClusterRole with get and patch on "
                                 "nodes.") from exc
            logger.warning("Cannot reach the Kubernetes API to look at node %r (%s: %s); cordoning may fail.",
                           node, type(exc).__name__, exc)

    def handle(self, failure: NodeFailure) -> str:
        api = kubernetes_core_api()
        body = cordon_patch(failure, pod=os.environ.get("HOSTNAME"))
        for attempt in range(1, self.attempts + 1):
            try:
                api.patch_node(failure.node, body, _content_type="application/merge-patch+json",
                               _request_timeout=self.timeout_s)
                return f"cordoned Kubernetes node {failure.node} ({REASON_LABEL}={_label_value(failure.reason)})"
            except Exception as exc:
                status = _api_status(exc)
                permanent = status is not None and 400 <= status < 500 and status not in (409, 429)
                if attempt == self.attempts or permanent:
                    raise FlashCkptError(f"Could not cordon Kubernetes node {failure.node} ({type(exc).__name__}: "
                                         f"{exc}). Cordon it by hand: kubectl cordon {failure.node}") from exc
                time.sleep(attempt)
        raise AssertionError("unreachable")


# --- registries -----------------------------------------------------------------------------------


_HANDLERS: dict[str, type[NodeFailureHandler]] = {}
_CLASSIFIERS: dict[str, NodeFailureClassifier] = {}
_plugins_loaded = False


def register_node_failure_handler(handler: type[NodeFailureHandler]) -> type[NodeFailureHandler]:
    """Register a :class:`NodeFailureHandler` subclass by its ``name`` (usable as a decorator)."""
    if not (isinstance(handler, type) and issubclass(handler, NodeFailureHandler) and getattr(handler, "name", "")):
        raise TypeError(f"register_node_failure_handler takes a NodeFailureHandler subclass with a `name`, "
                        f"got {handler!r}.")
    _HANDLERS[handler.name] = handler
    return handler


def register_node_failure_classifier(classifier: NodeFailureClassifier,
                                     name: str | None = None) -> NodeFailureClassifier:
    """Register a classifier, ``(WorkerFailure) -> reason or None`` (usable as a decorator)."""
    if not callable(classifier):
        raise TypeError(f"register_node_failure_classifier takes a callable, got {classifier!r}.")
    _CLASSIFIERS[name or getattr(classifier, "__qualname__", repr(classifier))] = classifier
    return classifier


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for group, register in ((HANDLER_GROUP, register_node_failure_handler),
                            (CLASSIFIER_GROUP, register_node_failure_classifier)):
        for entry_point in importlib.metadata.entry_points(group=group):
            try:
                register(entry_point.load())
            except Exception as exc:  # one broken package must not stop the launcher; it is named
                logger.warning("Skipping %s plugin %s (%s): %s", group, entry_point.name, entry_point.value, exc)


def registered_node_failure_handlers() -> list[str]:
    _load_plugins()
    return sorted(_HANDLERS)


def node_failure_classifiers() -> list[NodeFailureClassifier]:
    _load_plugins()
    return list(_CLASSIFIERS.values())


def select_node_failure_handler(name: str | None = None) -> NodeFailureHandler:
    """The handler named ``name`` (else ``$FLASHCKPT_NODE_FAILURE_HANDLER``, else ``log``)."""
    name = name or os.environ.get(HANDLER_ENV) or LogNodeFailureHandler.name
    _load_plugins()
    if name not in _HANDLERS:
        raise ValueError(f"No node failure handler is registered as {name!r}; registered: "
                         f"{registered_node_failure_handlers()}. Install the plugin that provides it "
                         f"(entry-point group {HANDLER_GROUP}).")
    return _HANDLERS[name]()


@register_node_failure_classifier
def sigbus(failure: WorkerFailure) -> str | None:
    """SIGBUS: memory the node cannot read, unless ``/dev/shm`` is (nearly) full."""
    if failure.exitcode != -signal.SIGBUS:
        return None
    try:
        stat = os.statvfs(SHM_DIR)
        if stat.f_blocks and stat.f_bavail / stat.f_blocks < SHM_FULL_FRACTION:
            logger.warning("Rank %d died of SIGBUS with %s full: counted as the job's, not the node's.",
                           failure.rank, SHM_DIR)
            return None
    except OSError:
        pass
    return "sigbus"


for _handler in (LogNodeFailureHandler, KubernetesNodeFailureHandler):
    register_node_failure_handler(_handler)


# --- the node check's verdict ---------------------------------------------------------------------


class CheckVerdict(str, enum.Enum):
    THIS_NODE = "this node"
    OTHER_NODES = "other nodes"
    UNKNOWN = "unknown"


def _check_ranks(error: NodeCheckError) -> tuple[set[int], Any]:
    """This node's ranks in the check (every one exits non-zero when the check fails) and the report."""
    cause = error.__cause__
    return set(getattr(cause, "failures", None) or {}), error.report


def judge_node_check(error: NodeCheckError) -> CheckVerdict:
    """Whether a failed node check named this node, only others, or cannot tell (no report)."""
    mine, report = _check_ranks(error)
    if report is None or not mine:
        return CheckVerdict.UNKNOWN
    bad = set(report.failed) | set(report.slow)
    return CheckVerdict.THIS_NODE if mine & bad else CheckVerdict.OTHER_NODES


def nodes_left(error: NodeCheckError) -> tuple[int, int]:
    """(nodes in the failed check, nodes it did not name): a node starts at each local rank 0."""
    report = error.report
    if report is None:
        return 0, 0
    node_of: dict[int, int] = {}
    node = -1
    for result in sorted(report.ranks, key=lambda r: r.rank):
        if result.local_rank == 0 or node < 0:
            node += 1
        node_of[result.rank] = node
    bad = {node_of[r] for r in set(report.failed) | set(report.slow) if r in node_of}
    total = node + 1
    return total, total - len(bad)


# --- the monitor ----------------------------------------------------------------------------------


class NodeFailureMonitor:
    """Decides when this node is faulty and reports it through the handler (see the module doc)."""

    def __init__(self, handler: NodeFailureHandler, node: str, *, threshold: int = DEFAULT_THRESHOLD,
                 classifiers: list[NodeFailureClassifier] | None = None) -> None:
        if threshold < 1:
            raise ValueError(f"--node-failure-threshold must be at least 1 (failures of the node's workers "
                             f"before it leaves the job), got {threshold}.")
        self.handler = handler
        self.node = node
        self.threshold = threshold
        self.classifiers = node_failure_classifiers() if classifiers is None else classifiers
        self.counted: list[str] = []

    def node_check_failed(self, error: NodeCheckError) -> NodeFailure:
        mine, report = _check_ranks(error)
        wheres = {result.where for result in report.ranks if result.rank in mine} if report else set()
        lines = [line for line in report.problems() if line.split(":", 1)[0] in wheres] if report else []
        return NodeFailure(self.node, "node-check", "; ".join(lines) or str(error))

    def classify(self, failure: WorkerFailure) -> str | None:
        for classifier in self.classifiers:
            try:
                reason = classifier(failure)
            except Exception as exc:  # a broken plugin must not take the node out, nor keep it in silently
                logger.warning("Node failure classifier %r failed on rank %d: %s: %s", classifier, failure.rank,
                               type(exc).__name__, exc)
                continue
            if reason:
                return str(reason)
        return None

    def workers_failed(self, failures: Mapping[int, Any], error_text: Callable[[Any], str]) -> NodeFailure | None:
        """Count this failed worker group (``ProcessFailure`` by global rank) when a classifier puts a
        failure down to the node; the :class:`NodeFailure` once the count reaches the threshold."""
        found = []
        for rank, failure in sorted(failures.items()):
            if failure.exitcode == -signal.SIGTERM:
                continue  # stopped by the agent after another rank failed
            worker = WorkerFailure(rank=rank, local_rank=failure.local_rank, exitcode=failure.exitcode,
                                   signal=failure.signal_name() if failure.exitcode < 0 else None,
                                   error=_safe(error_text, failure))
            reason = self.classify(worker)
            if reason:
                how = f"killed by {worker.signal}" if worker.signal else f"exit code {worker.exitcode}"
                found.append((reason, f"rank {rank} (local rank {worker.local_rank}) {how}"))
        if not found:
            return None
        self.counted.append("; ".join(what for _, what in found))
        if len(self.counted) < self.threshold:
            logger.warning("Worker failure %d of %d on node %s that points at the node: %s", len(self.counted),
                           self.threshold, self.node, self.counted[-1])
            return None
        return NodeFailure(self.node, found[0][0], f"{len(self.counted)} worker failures that point at the node "
                           f"(--node-failure-threshold {self.threshold}): " + " | ".join(self.counted))

    def report(self, failure: NodeFailure) -> tuple[int, str]:
        """Run the handler; return the launcher's exit code and what the handler did (or why not)."""
        try:
            done = self.handler.handle(failure)
        except Exception as exc:  # the node leaves the job all the same
            done = f"the {self.handler.name} handler failed: {type(exc).__name__}: {exc}"
        return NODE_FAILURE_EXIT_CODE, done


def _safe(error_text: Callable[[Any], str], failure: Any) -> str:
    try:
        return error_text(failure) or ""
    except Exception:  # the text is a help for plugins, never a reason to fail
        return ""


# --- leaving the rendezvous -----------------------------------------------------------------------


def leave_rendezvous(handler: Any, timeout_s: float | None = None) -> bool:
    """Take this node out of torch's dynamic (c10d) rendezvous without closing it for the others
    (``shutdown()`` would close it): stop its heartbeats and remove it from the participants, as
    torch does at the start of each ``next_rendezvous``. False for other handlers or on failure;
    then the others drop this node once its heartbeats expire."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, _RendezvousExitOp

    if not isinstance(handler, DynamicRendezvousHandler):
        return False
    try:
        handler._stop_heartbeats()
        timeout = handler.settings.timeout.close.total_seconds() if timeout_s is None else timeout_s
        with handler._heartbeat_lock:
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + timeout)
        return True
    except Exception as exc:
        logger.warning("Could not leave the rendezvous (%s: %s); the other nodes drop this one when its "
                       "heartbeats expire.", type(exc).__name__, exc)
        return False
