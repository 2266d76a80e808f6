"""``--auto-config``: torchrun options from Kubeflow / torchrun-style environments and the node's devices."""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashckpt_integrations.launcher.auto_config import (
    LocalDevices,
    auto_config_args,
    cgroup_cpu_limit,
    cpu_slots,
    detect_local_devices,
    resolve_auto_config,
)

GPUS = LocalDevices("cuda", 8, "test")
SCRIPT = ["train.py", "--lr", "0.1"]


def added(argv, env, devices=GPUS):
    return list(resolve_auto_config(argv, env, devices=devices).added)


def test_kubeflow_pytorchjob_up_to_v1_6_world_size_counts_pods():
    env = {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    decision = resolve_auto_config(SCRIPT, env, devices=GPUS)
    assert list(decision.argv) == ["--nnodes=3", "--nproc-per-node=8", "--node-rank=2",
                                   "--master-addr=job-master-0", "--master-port=23456", *SCRIPT]
    assert decision.devices == GPUS
    assert decision.nnodes.source == "WORLD_SIZE" and decision.node_rank.source == "RANK"
    line = decision.describe()
    assert "\n" not in line
    assert "nnodes=3 (WORLD_SIZE)" in line and "nproc-per-node=8 (cuda: test)" in line


def test_kubeflow_pytorchjob_v1_7_world_size_counts_processes():
    env = {"WORLD_SIZE": "32", "RANK": "1", "PET_NODE_RANK": "1", "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8",
           "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "job-master-0"}
    decision = resolve_auto_config(SCRIPT, env, devices=LocalDevices("cuda", 2, "unused"))
    assert list(decision.added) == ["--nnodes=4", "--nproc-per-node=8", "--node-rank=1",
                                    "--master-addr=job-master-0", "--master-port=23456"]
    assert decision.devices is None  # the environment decided; the devices were not probed
    assert decision.nnodes.source == "PET_NNODES" and decision.nproc_per_node.source == "PET_NPROC_PER_NODE"


def test_kubeflow_trainer_v2_auto_processes_per_node_uses_the_devices():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "0",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
    decision = resolve_auto_config(SCRIPT, env, devices=GPUS)
    assert list(decision.added) == ["--nnodes=2", "--nproc-per-node=8", "--node-rank=0",
                                    "--master-addr=job-node-0-0.job", "--master-port=29400"]
    assert decision.nproc_per_node.source == "PET_NPROC_PER_NODE=auto -> cuda: test"


def test_torchrun_style_variables():
    env = {"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert added(SCRIPT, env) == ["--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=10.0.0.1",
                                  "--master-port=29500"]


def test_explicit_arguments_win_even_over_a_conflicting_environment():
    argv = ["--nnodes=1", "--nproc_per_node", "2", "--node-rank", "0", "--master-port=1234", *SCRIPT]
    env = {"PET_NNODES": "4", "NNODES": "5", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "3", "NODE_RANK": "2",
           "MASTER_ADDR": "head", "MASTER_PORT": "9"}
    decision = resolve_auto_config(argv, env, devices=GPUS)
    assert list(decision.argv) == ["--master-addr=head", *argv]
    assert decision.nnodes.given and decision.nnodes.value == "1"
    assert decision.nproc_per_node.value == "2" and decision.master_port.value == "1234"


def test_options_after_the_script_belong_to_the_script():
    argv = ["train.py", "--nnodes", "7", "--nproc-per-node=3"]
    decision = resolve_auto_config(argv, {"PET_NNODES": "2"}, devices=GPUS)
    assert list(decision.argv) == ["--nnodes=2", "--nproc-per-node=8", *argv]


def test_nothing_in_the_environment_fills_only_the_processes_per_node():
    decision = resolve_auto_config(SCRIPT, {}, devices=LocalDevices("cpu", 2, "2 CPUs in the affinity mask"))
    assert list(decision.argv) == ["--nproc-per-node=2", *SCRIPT]
    assert "nnodes=torchrun default" in decision.describe()


def test_standalone_and_dynamic_rendezvous_leave_node_options_to_torchrun():
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "1"}
    assert added(["--standalone", *SCRIPT], env) == ["--nproc-per-node=8"]
    dynamic = ["--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", *SCRIPT]
    assert added(dynamic, env) == ["--nnodes=2", "--nproc-per-node=8"]
    assert added(SCRIPT, {**env, "PET_RDZV_ENDPOINT": "head:29400", "PET_RDZV_BACKEND": "c10d"}) == [
        "--nnodes=2", "--nproc-per-node=8"]


@pytest.mark.parametrize("env, names", [
    ({"PET_NNODES": "2", "NNODES": "3"}, ["PET_NNODES='2'", "NNODES='3'"]),
    ({"PET_MASTER_ADDR": "a", "MASTER_ADDR": "b"}, ["PET_MASTER_ADDR='a'", "MASTER_ADDR='b'"]),
    ({"PET_MASTER_PORT": "1", "MASTER_PORT": "2"}, ["PET_MASTER_PORT='1'", "MASTER_PORT='2'"]),
    ({"PET_NODE_RANK": "1", "RANK": "2", "WORLD_SIZE": "4"}, ["PET_NODE_RANK='1'", "RANK='2'"]),
    ({"PET_NPROC_PER_NODE": "8", "NPROC_PER_NODE": "4"}, ["PET_NPROC_PER_NODE='8'", "NPROC_PER_NODE='4'"]),
    ({"PET_NNODES": "4", "PET_NPROC_PER_NODE": "2", "WORLD_SIZE": "6"}, ["PET_NNODES='4'", "WORLD_SIZE='6'"]),
])
def test_conflicting_variables_are_named(env, names):
    with pytest.raises(ValueError, match="disagrees") as caught:
        auto_config_args(SCRIPT, env)
    for name in names:
        assert name in str(caught.value)


def test_invalid_values_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"Node rank 2 \(from PET_NODE_RANK\) is outside 0..1"):
        resolve_auto_config(SCRIPT, {"PET_NNODES": "2", "PET_NODE_RANK": "2"}, devices=GPUS)
    with pytest.raises(ValueError, match="PET_NNODES='0' is not a node count"):
        resolve_auto_config(SCRIPT, {"PET_NNODES": "0"}, devices=GPUS)
    with pytest.raises(ValueError, match="MASTER_PORT='x' must be an integer"):
        resolve_auto_config(SCRIPT, {"MASTER_PORT": "x"}, devices=GPUS)
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE=gpu but this node shows no GPU"):
        resolve_auto_config(SCRIPT, {"PET_NPROC_PER_NODE": "gpu"}, devices=LocalDevices("cpu", 2, "x"))
    with pytest.raises(ValueError, match="training_script"):
        auto_config_args(["--nnodes=2"], {})


def test_elastic_node_range_is_passed_through():
    assert added(SCRIPT, {"PET_NNODES": "1:4", "WORLD_SIZE": "3"}) == ["--nnodes=1:4", "--nproc-per-node=8"]


def test_real_device_probe_and_default_environment():
    found = detect_local_devices()
    cuda = torch.cuda.device_count()
    assert (found.kind, found.count) == ("cuda", cuda) if cuda else found.kind in ("npu", "cpu")
    assert found.count >= 1
    argv = auto_config_args(SCRIPT, {})
    assert argv == [f"--nproc-per-node={found.count}", *SCRIPT]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_takes_the_tightest_ancestor(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/kubepods/pod1/ctr\n")
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")
    write(root / "kubepods" / "cpu.max", "800000 100000\n")
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) == 2.5
    slots = cpu_slots(str(root), str(tmp_path / "self"))
    affinity = len(os.sched_getaffinity(0))
    assert slots.count == (min(affinity, 2) if affinity > 2.5 else affinity)


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "4:memory:/x\n2:cpu,cpuacct:/\n0::/\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "150000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "memory" / "x" / "cpu.cfs_quota_us", "1000\n")  # not the cpu controller: ignored
    write(root / "memory" / "x" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) == 1.5
    slots = cpu_slots(str(root), str(tmp_path / "self"))
    assert slots.count == max(1, min(len(os.sched_getaffinity(0)), math.floor(1.5)))
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) is None
    assert cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path / "missing-self")) is None
