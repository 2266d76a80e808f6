"""The manifests in examples/kubernetes/ agree with the launcher: their flashckpt-run command lines
parse, the node name comes from the downward API, the exit code they retry is the launcher's, and
the RBAC rule allows what the cordon and the switch label need."""

from __future__ import annotations

import os
import re

import pytest

from flashckpt_integrations.launcher import node_failure, run, topology
from tests.distributed.launch import REPO

yaml = pytest.importorskip("yaml")
EXAMPLES = os.path.join(REPO, "examples", "kubernetes")


def documents(name: str) -> list[dict]:
    with open(os.path.join(EXAMPLES, name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def containers(doc: dict):
    """Every container of a PyTorchJob or a TrainingRuntime."""
    if doc["kind"] == "PyTorchJob":
        for replica in doc["spec"]["pytorchReplicaSpecs"].values():
            yield replica, replica["template"]["spec"]
    elif doc["kind"] == "TrainingRuntime":
        for job in doc["spec"]["template"]["spec"]["replicatedJobs"]:
            yield job["template"]["spec"], job["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "trainjob.yaml"])
def test_the_job_manifests_run_flashckpt_run_with_both_features(name):
    found = 0
    for doc in documents(name):
        for owner, pod in containers(doc):
            assert pod["serviceAccountName"] == "flashckpt-launcher"
            for container in pod["containers"]:
                found += 1
                command = [re.sub(r"\$\((\w+)\)", "value", part) for part in container["command"]]
                assert command[0] == "flashckpt-run"
                args = run.parse_args(command[1:])
                assert args.node_check and args.topology_key and args.node_failure_handler == "kubernetes"
                assert args.rdzv_backend in ("static", "c10d")  # static: PyTorchJob's PET_RDZV_BACKEND=c10d wins
                env = {e["name"]: e for e in container["env"]}
                assert env[topology.NODE_NAME_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
                if doc["kind"] == "PyTorchJob":
                    assert owner["restartPolicy"] == "ExitCode"
                    assert doc["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
                else:
                    assert args.rdzv_backend == "c10d" and args.nnodes == "3:4"
                    (rule,) = owner["podFailurePolicy"]["rules"]
                    assert rule["action"] == "Ignore"
                    assert rule["onExitCodes"]["values"] == [node_failure.NODE_FAILURE_EXIT_CODE]
                    assert rule["onExitCodes"]["containerName"] == container["name"]
                    assert pod["restartPolicy"] == "Never"  # what a podFailurePolicy needs
    assert found


def test_the_rbac_rule_allows_get_and_patch_on_nodes_for_the_jobs_service_account():
    by_kind = {doc["kind"]: doc for doc in documents("rbac.yaml")}
    (rule,) = by_kind["ClusterRole"]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}
    binding = by_kind["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == by_kind["ServiceAccount"]["metadata"]["name"] == "flashckpt-launcher"
