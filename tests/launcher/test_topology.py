"""Node ranks ordered by switch: the sources of a node's switch, the order, the rendezvous handler
in threads of this process, and four simulated nodes under ``flashckpt-run`` across a restart and a
scale-down."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.launcher.api import LaunchConfig

from flashckpt_integrations.errors import MissingDependencyError
from flashckpt_integrations.launcher import topology
from flashckpt_integrations.launcher.topology import NodeOrder, Place
from tests.distributed.launch import REPO
from tests.k8s_api_server import KubernetesApiTestServer
from tests.launcher import cluster


def test_topology_files_map_node_names_to_switches(tmp_path):
    assert topology.expand_hostlist("gpu[01-03,07],login1,n[8-9]x") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login1", "n8x", "n9x"]
    slurm = ("# leaf switches\nSwitchName=s0 Nodes=dev[0-1]\nSwitchName=s1 Nodes=dev2,dev3\n"
             "SwitchName=top Switches=s[0-1]\n")
    assert topology.parse_topology(slurm) == {"dev0": "s0", "dev1": "s0", "dev2": "s1", "dev3": "s1"}
    assert topology.parse_topology('{"a": "s1", "b.cluster.local": "s2"}') == {"a": "s1", "b.cluster.local": "s2"}
    assert topology.parse_topology("a s1  # rack 4\n\nb s2\n") == {"a": "s1", "b": "s2"}
    with pytest.raises(ValueError, match="Line 2 .* like 'node-1 switch-a'"):
        topology.parse_topology("a s1\nb\n")
    with pytest.raises(ValueError, match="name\\[1-4,7\\]"):
        topology.expand_hostlist("n[a-b]")

    path = tmp_path / "topology.txt"
    path.write_text("b.cluster.local s2\na s1\n")
    assert topology.resolve_switch("b", topology_file=str(path)) == "s2"  # short names match
    assert topology.resolve_switch("a.cluster.local", topology_file=str(path)) == "s1"
    assert topology.resolve_switch("a", switch="given", topology_file=str(path)) == "given"  # the first source wins
    assert topology.resolve_switch("zz", topology_file=str(path)) is None
    with pytest.raises(ValueError, match="Cannot read the topology file"):
        topology.resolve_switch("a", topology_file=str(tmp_path / "missing"))


def test_a_kubernetes_node_label_names_the_switch(tmp_path, monkeypatch, caplog):
    from flashckpt_integrations.launcher import node_failure

    with KubernetesApiTestServer({"host-a": {cluster.SWITCH_LABEL: "rack-2"}, "host-b": {}}) as server:
        monkeypatch.setenv("KUBECONFIG", server.write_kubeconfig(tmp_path / "kubeconfig"))
        node_failure._kubernetes_core_api.cache_clear()
        try:
            assert topology.resolve_switch("host-a", topology_key=cluster.SWITCH_LABEL) == "rack-2"
            with caplog.at_level(logging.WARNING):
                assert topology.resolve_switch("host-b", topology_key=cluster.SWITCH_LABEL) is None
                assert topology.resolve_switch("host-x", topology_key=cluster.SWITCH_LABEL) is None
        finally:
            node_failure._kubernetes_core_api.cache_clear()
    assert "has no label example.com/switch" in caplog.text and "Cannot read label" in caplog.text
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # a setup to fix, said at the start
    with pytest.raises(MissingDependencyError, match="flashckpt-integrations\\[kubernetes\\]"):
        topology.resolve_switch("host-a", topology_key=cluster.SWITCH_LABEL)
    node_failure._kubernetes_core_api.cache_clear()


def test_torch_elastic_never_imports_the_package_by_itself():
    # The stock loaders run in processes that never import this package; torch elastic must not
    # pull it in through an entry point, and flashckpt-run registers the backend itself.
    code = ("import sys\nimport torch.distributed.run\n"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
            "print(any(m.startswith('flashckpt_integrations') for m in sys.modules), 'c10d-topology' in r._registry)\n"
            "from flashckpt_integrations.launcher import topology\ntopology.register()\n"
            "print(r._registry.get('c10d-topology') is topology.create_rendezvous_handler)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0 and done.stdout.split() == ["False", "False", "True"], done.stdout + done.stderr


def test_order_by_switch_then_name_and_unknown_switches_last_in_torchs_order():
    places = {"d3": Place("s2", "b"), "d1": Place("s1", "z"), "d0": None, "d2": Place("s1", "a"),
              "d4": Place(None, "c")}
    assert topology.order_nodes(places) == ["d2", "d1", "d3", "d0", "d4"]
    assert topology.order_nodes(dict.fromkeys(["d2", "d0", "d1"])) == ["d0", "d1", "d2"]  # torch's: sorted
    order = NodeOrder(3, ((0, Place("s1", "a")), (1, Place("s1", "z")), (2, Place("s2", "b")), (3, None)))
    assert str(order) == "round 3: switch s1 -> node ranks 0 (a), 1 (z); switch s2 -> node ranks 2 (b); " \
                         "no known switch -> node ranks 3"


def _config(**changes) -> LaunchConfig:
    return dataclasses.replace(LaunchConfig(min_nodes=3, max_nodes=4, nproc_per_node=1, rdzv_backend="c10d",
                                            rdzv_endpoint="127.0.0.1:1", rdzv_configs={"timeout": 9}), **changes)


def test_without_topology_information_the_launch_config_is_torchs(monkeypatch):
    for name in (topology.SWITCH_ENV, topology.FILE_ENV, topology.KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    config = _config()
    before = copy.deepcopy(config)
    assert topology.configure(config, node="host-a") is None
    assert config == before

    assert topology.configure(config, node="host-a", switch="rack-1") == Place("rack-1", "host-a")
    assert config.rdzv_backend == topology.BACKEND
    assert config.rdzv_configs == {"timeout": 9, "node_name": "host-a", "switch": "rack-1"}
    monkeypatch.setenv(topology.SWITCH_ENV, "rack-9")
    assert topology.configure(_config(), node="host-a") == Place("rack-9", "host-a")
    with pytest.raises(ValueError, match=r"needs the c10d rendezvous.*'static' \(the node rank comes from --node-rank"):
        topology.configure(_config(rdzv_backend="static"), switch="rack-1")


def test_the_handler_orders_ranks_by_switch_and_without_switches_keeps_torchs_order():
    topology.register()
    ranks = cluster.rendezvous_in_threads(topology.BACKEND, dict(cluster.SWITCHES), "by-switch")
    assert sorted(ranks, key=lambda n: ranks[n][0]) == cluster.switch_order(cluster.HOSTS)
    assert all(type(handler) is topology.TopologyRendezvousHandler for _, handler in ranks.values())
    rank0 = next(handler for rank, handler in ranks.values() if rank == 0)
    assert str(rank0.last_order) == ("round 0: switch rack-1 -> node ranks 0 (host-b), 1 (host-d); "
                                     "switch rack-2 -> node ranks 2 (host-a), 3 (host-c)")

    # No switch known: the same ranks as torch's own c10d handler, which sorts its node descriptors.
    for backend in (topology.BACKEND, "c10d"):
        ranks = cluster.rendezvous_in_threads(backend, dict.fromkeys(cluster.HOSTS), f"no-switch-{backend}")
        descriptors = {name: handler._this_node for name, (_, handler) in ranks.items()}
        assert [ranks[n][0] for n in sorted(descriptors, key=descriptors.get)] == [0, 1, 2, 3]
        if backend == "c10d":
            assert all(type(handler) is DynamicRendezvousHandler for _, handler in ranks.values())


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_four_nodes_ranks_follow_switches_across_a_restart_and_a_scale_down(tmp_path):
    """Switches from a Kubernetes node label. In the first round host-b's script raises (its node
    restarts its worker: no cordon) and host-c's worker dies of SIGBUS (threshold 1: host-c is
    cordoned, leaves, exits 138); the other three go on as three nodes, host-b's restarted worker
    among them, every round in switch order."""
    out = tmp_path / "out"
    with KubernetesApiTestServer({h: {cluster.SWITCH_LABEL: s} for h, s in cluster.SWITCHES.items()}) as server:
        options = ["--topology-key", cluster.SWITCH_LABEL, "--node-failure-handler", "kubernetes",
                   "--node-failure-threshold", "1"]
        results, codes, tails = cluster.run(out, options, ["--raise-on", "host-b", "--sigbus-on", "host-c"],
                                            KUBECONFIG=server.write_kubeconfig(tmp_path / "kubeconfig"))
        assert codes == {"host-a": 0, "host-b": 0, "host-c": 138, "host-d": 0}, tails
        orders = cluster.assert_ranks_follow_switches(out)
        assert orders[0] == ["host-b", "host-d", "host-a", "host-c"] and orders[-1] == ["host-b", "host-d", "host-a"]
        (patch,) = server.patches("host-c")
        assert [h for h in cluster.HOSTS if server.patches(h)] == ["host-c"], "a Python exception cordons nothing"
    assert patch["spec"] == {"unschedulable": True}
    assert patch["metadata"]["labels"]["flashckpt.io/cordon-reason"] == "sigbus"
    assert server.nodes["host-c"]["spec"]["unschedulable"] is True
    host_b, host_c = results["host-b"][1], results["host-c"][1]
    assert "injected failure in the training script on host-b" in host_b and "restarting the workers" in host_b
    assert "killed by signal 7 (SIGBUS)" in host_c and "exiting with 138" in host_c
    assert "cordoned Kubernetes node host-c (flashckpt.io/cordon-reason=sigbus)" in host_c
    assert ("node ranks by switch, round 0: switch rack-1 -> node ranks 0 (host-b), 1 (host-d); "
            "switch rack-2 -> node ranks 2 (host-a), 3 (host-c)") in host_b
    assert "switch rack-1 -> node ranks 0 (host-b), 1 (host-d); switch rack-2 -> node ranks 2 (host-a)\n" in host_b
