"""Faulty nodes: the classifier, the threshold, the node check's verdict, the handlers (Kubernetes
with the real client against a loopback API server), and four simulated nodes under
``flashckpt-run`` whose node check fails on one."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import types

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

from flashckpt_integrations.errors import FlashCkptError, MissingDependencyError, NodeCheckError
from flashckpt_integrations.launcher import node_failure, run
from flashckpt_integrations.launcher.node_check import RankResult, evaluate
from flashckpt_integrations.launcher.node_failure import (
    NODE_FAILURE_EXIT_CODE,
    CheckVerdict,
    KubernetesNodeFailureHandler,
    LogNodeFailureHandler,
    NodeFailure,
    NodeFailureHandler,
    NodeFailureMonitor,
    WorkerFailure,
)
from tests.distributed.launch import free_port
from tests.k8s_api_server import KubernetesApiTestServer
from tests.launcher import cluster


def failure(exitcode: int, local_rank: int = 0) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file="")


def worker(exitcode: int) -> WorkerFailure:
    return WorkerFailure(rank=0, local_rank=0, exitcode=exitcode, signal=None, error="")


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """A loopback API server with two nodes, and the client pointed at it."""
    with KubernetesApiTestServer({"host-a": {}, "host-b": {}}) as server:
        monkeypatch.setenv("KUBECONFIG", server.write_kubeconfig(tmp_path / "kubeconfig"))
        node_failure._kubernetes_core_api.cache_clear()
        yield server
    node_failure._kubernetes_core_api.cache_clear()


def test_the_exit_code_is_one_kubeflow_retries():
    # training-operator's ExitCode policy retries 128-255 now, and 130/137/138/143 in older releases
    assert NODE_FAILURE_EXIT_CODE == 138 == 128 + signal.SIGUSR1


def test_only_sigbus_points_at_the_node_and_not_with_shm_full(monkeypatch):
    assert node_failure.sigbus(worker(-signal.SIGBUS)) == "sigbus"
    for code in (1, 2, -signal.SIGSEGV, -signal.SIGKILL, -signal.SIGABRT):
        assert node_failure.sigbus(worker(code)) is None
    full = os.statvfs_result((4096, 4096, 1000, 5, 5, 100, 50, 50, 0, 255))
    monkeypatch.setattr(node_failure.os, "statvfs", lambda path: full)
    assert node_failure.sigbus(worker(-signal.SIGBUS)) is None


def test_the_node_leaves_after_threshold_classified_failures_and_never_for_an_exception(caplog):
    monitor = NodeFailureMonitor(LogNodeFailureHandler(), "host-a", threshold=2)
    text = lambda f: "Traceback ...\nRuntimeError: CUDA error: uncorrectable ECC error encountered"  # noqa: E731
    for _ in range(3):  # a Python exception, whatever it says, and the ranks the agent stopped after it
        assert monitor.workers_failed({0: failure(1), 1: failure(-signal.SIGTERM, 1)}, text) is None
    assert monitor.workers_failed({3: failure(-signal.SIGBUS)}, text) is None
    found = monitor.workers_failed({2: failure(1, 1), 3: failure(-signal.SIGBUS)}, text)
    assert found is not None and found.node == "host-a" and found.reason == "sigbus"
    assert "2 worker failures that point at the node (--node-failure-threshold 2)" in found.detail
    assert "rank 3 (local rank 0) killed by SIGBUS" in found.detail
    with pytest.raises(ValueError, match="at least 1"):
        NodeFailureMonitor(LogNodeFailureHandler(), "host-a", threshold=0)


def test_a_classifier_plugin_decides_and_a_broken_one_is_skipped(caplog):
    def xid(f: WorkerFailure) -> str | None:
        return "gpu-xid-79" if "Xid 79" in f.error else None

    def broken(f: WorkerFailure) -> str | None:
        raise KeyError("oops")

    monitor = NodeFailureMonitor(LogNodeFailureHandler(), "host-a", threshold=1, classifiers=[broken, xid])
    found = monitor.workers_failed({5: failure(1)}, lambda f: "NCCL error: Xid 79, GPU has fallen off the bus")
    assert found.reason == "gpu-xid-79" and "rank 5 (local rank 0) exit code 1" in found.detail
    assert "Node failure classifier" in caplog.text and "KeyError" in caplog.text


def _check_error(bad: set[int], mine: set[int], nproc: int = 1, nodes: int = 4) -> NodeCheckError:
    results = [RankResult(rank=r, local_rank=r % nproc, hostname="vm", check="cpu",
                          compute_s=None if r in bad else 0.01, error="RuntimeError: boom" if r in bad else None)
               for r in range(nodes * nproc)]
    report = evaluate(results)
    error = NodeCheckError(report.summary(), report=report)
    error.__cause__ = ChildFailedError("node_check", {r: failure(1, r % nproc) for r in mine})
    return error


def test_the_node_check_verdict_names_this_node_or_others():
    assert node_failure.judge_node_check(_check_error({3}, {2, 3}, nproc=2)) is CheckVerdict.THIS_NODE
    assert node_failure.judge_node_check(_check_error({3}, {0, 1}, nproc=2)) is CheckVerdict.OTHER_NODES
    assert node_failure.judge_node_check(NodeCheckError("crashed before it could report")) is CheckVerdict.UNKNOWN
    assert node_failure.nodes_left(_check_error({3, 5}, {0, 1}, nproc=2)) == (4, 2)
    assert node_failure.nodes_left(_check_error({1}, {0})) == (4, 3)

    found = NodeFailureMonitor(LogNodeFailureHandler(), "host-d").node_check_failed(_check_error({3}, {3}))
    assert (found.node, found.reason) == ("host-d", "node-check")
    assert found.detail == "vm rank 3 (local rank 0): RuntimeError: boom"


def test_handlers_are_selected_by_name_and_plugins_register(monkeypatch):
    monkeypatch.delenv(node_failure.HANDLER_ENV, raising=False)
    assert type(node_failure.select_node_failure_handler()) is LogNodeFailureHandler
    assert type(node_failure.select_node_failure_handler("kubernetes")) is KubernetesNodeFailureHandler
    monkeypatch.setenv(node_failure.HANDLER_ENV, "kubernetes")
    assert type(node_failure.select_node_failure_handler()) is KubernetesNodeFailureHandler

    class Pager(NodeFailureHandler):
        name = "test-pager"

        def handle(self, failure: NodeFailure) -> str:
            return f"paged about {failure.node}"

    node_failure.register_node_failure_handler(Pager)
    try:
        pager = node_failure.select_node_failure_handler("test-pager")
        assert pager.handle(NodeFailure("n", "x", "y")) == "paged about n"
        with pytest.raises(ValueError, match="No node failure handler is registered as 'nope'.*test-pager"):
            node_failure.select_node_failure_handler("nope")
    finally:
        node_failure._HANDLERS.pop("test-pager")
    with pytest.raises(TypeError):
        node_failure.register_node_failure_handler(object)  # type: ignore[arg-type]

    class Failing(NodeFailureHandler):
        name = "test-failing"

        def handle(self, failure: NodeFailure) -> str:
            raise OSError("no route")

    code, done = NodeFailureMonitor(Failing(), "n").report(NodeFailure("n", "x", "y"))
    assert code == NODE_FAILURE_EXIT_CODE and done == "the test-failing handler failed: OSError: no route"


def test_the_kubernetes_handler_cordons_with_the_reason_through_the_real_client(kube):
    handler = KubernetesNodeFailureHandler()
    handler.prepare("host-a")
    with pytest.raises(ValueError, match="no node named 'host-x'.*spec.nodeName"):
        handler.prepare("host-x")
    failure = NodeFailure("host-a", "node-check", "vm rank 3 (local rank 0): RuntimeError: boom")
    assert handler.handle(failure) == "cordoned Kubernetes node host-a (flashckpt.io/cordon-reason=node-check)"
    (patch,) = kube.patches("host-a")
    assert kube.patches("host-b") == []
    node = kube.nodes["host-a"]
    assert node["spec"]["unschedulable"] is True
    labels = node["metadata"]["labels"]
    assert labels["flashckpt.io/cordon-reason"] == "node-check" and labels["kubernetes.io/hostname"] == "host-a"
    assert labels["flashckpt.io/cordoned-at"] == failure.time.strftime("%Y%m%dT%H%M%SZ")
    detail = json.loads(node["metadata"]["annotations"]["flashckpt.io/cordon-detail"])
    assert detail["reason"] == "node-check" and detail["detail"] == failure.detail
    assert [kind for method, _, kind, _ in kube.requests if method == "PATCH"] == ["application/merge-patch+json"]

    handler.attempts = 1
    with pytest.raises(FlashCkptError, match="Cordon it by hand: kubectl cordon host-x"):
        handler.handle(NodeFailure("host-x", "sigbus", "..."))


def test_the_kubernetes_handler_without_the_client_or_credentials_says_what_to_do(monkeypatch, tmp_path):
    node_failure._kubernetes_core_api.cache_clear()
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'flashckpt-integrations\[kubernetes\]'"):
        KubernetesNodeFailureHandler().prepare("host-a")
    monkeypatch.delitem(sys.modules, "kubernetes")
    node_failure._kubernetes_core_api.cache_clear()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="No Kubernetes credentials"):
        KubernetesNodeFailureHandler().prepare("host-a")
    node_failure._kubernetes_core_api.cache_clear()


@pytest.mark.distributed
def test_a_replacement_node_checks_itself_alone_once_the_others_went_on(capsys):
    """The others' check rendezvous is over (closed): a node that joins later checks alone."""
    port = free_port()
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="late-node-check",
                                  min_nodes=2, max_nodes=4, is_host=True)
    others = rdzv_registry.get_rendezvous_handler(params)  # hosts the store, as the endpoint's node does
    others.set_closed()
    config = LaunchConfig(min_nodes=2, max_nodes=4, nproc_per_node=1, rdzv_backend="c10d", run_id="late",
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"is_host": False}, monitor_interval=0.1)
    assert run._node_check(config, timeout_s=60) is True
    assert "checking this node alone" in capsys.readouterr().err
    others.shutdown()


def test_a_node_leaves_the_rendezvous_without_closing_it_for_the_others():
    ranks = cluster.rendezvous_in_threads("c10d", dict.fromkeys(["host-a", "host-b", "host-c"]), "leave",
                                          shutdown=False)
    (_, leaving), (_, staying) = ranks["host-c"], ranks["host-a"]
    assert node_failure.leave_rendezvous(leaving) is True
    time.sleep(1.1)  # past the state holder's cache
    staying._state_holder.sync()
    state = staying._state_holder.state
    assert len(state.participants) == 2 and leaving._this_node not in state.participants
    assert not state.closed and not staying.is_closed()
    for _, handler in ranks.values():
        handler.shutdown()
    assert node_failure.leave_rendezvous(types.SimpleNamespace()) is False  # not torch's dynamic handler


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_node_whose_check_fails_is_cordoned_and_the_others_train(tmp_path):
    """Switches from a topology file (so the check's ranks follow them too: host-d is check rank 1);
    host-d's check raises: its launcher cordons host-d and exits 138, the other three train as three
    nodes in switch order, and no other node is touched."""
    out = tmp_path / "out"
    topology_file = tmp_path / "topology.txt"
    topology_file.write_text("".join(f"{host} {switch}\n" for host, switch in cluster.SWITCHES.items()))
    assert cluster.switch_order(cluster.HOSTS)[1] == "host-d"
    with KubernetesApiTestServer({h: {} for h in cluster.HOSTS}) as server:
        results, codes, tails = cluster.run(out, ["--node-check", "--node-check-timeout", "120", "--topology-file",
                                                  str(topology_file), "--node-failure-handler", "kubernetes"],
                                            KUBECONFIG=server.write_kubeconfig(tmp_path / "kubeconfig"),
                                            FLASHCKPT_NODE_CHECK_PLUGINS="tests.launcher.node_check_plugins",
                                            FLASHCKPT_TEST_FAIL_RANK="1")
        assert codes == {"host-a": 0, "host-b": 0, "host-c": 0, "host-d": 138}, tails
        assert [h for h in cluster.HOSTS if server.patches(h)] == ["host-d"]
        (patch,) = server.patches("host-d")
    assert patch["spec"] == {"unschedulable": True}
    assert patch["metadata"]["labels"]["flashckpt.io/cordon-reason"] == "node-check"
    detail = json.loads(patch["metadata"]["annotations"]["flashckpt.io/cordon-detail"])
    assert "injected failure on rank 1" in detail["detail"]
    assert cluster.assert_ranks_follow_switches(out) == [["host-b", "host-a", "host-c"]]
    host_d = results["host-d"][1]
    assert "node host-d is faulty (node-check)" in host_d and "exiting with 138" in host_d
    assert "the node check named other nodes only: going on with 3 of 4 nodes" in results["host-a"][1]
