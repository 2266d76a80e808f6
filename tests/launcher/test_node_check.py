"""The node check: verdicts and plugins in-process, then 2 gloo ranks through elastic_launch and torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from flashckpt_integrations import knobs
from flashckpt_integrations.errors import FlashCkptError, NodeCheckError
from flashckpt_integrations.launcher import node_check
from flashckpt_integrations.launcher.node_check import (
    CpuNodeCheck,
    NodeCheck,
    NodeCheckReport,
    RankResult,
    evaluate,
    register_node_check,
    run_node_check,
    select_node_check,
)
from tests.distributed.launch import REPO, free_port

PLUGINS = "tests.launcher.node_check_plugins"  # not imported here: importing it registers its check
SLOW_RANK, FAIL_RANK = "FLASHCKPT_TEST_SLOW_RANK", "FLASHCKPT_TEST_FAIL_RANK"
HOST = socket.gethostname()


@pytest.fixture
def registry():
    """Registrations made by a test are undone after it."""
    saved = dict(node_check._REGISTRY)
    yield
    node_check._REGISTRY.clear()
    node_check._REGISTRY.update(saved)


def result(rank: int, seconds: float | None, host: str = "node-a", error: str | None = None) -> RankResult:
    return RankResult(rank=rank, local_rank=rank % 2, hostname=host, check="cpu", compute_s=seconds, error=error)


def test_evaluate_flags_failed_and_slow_ranks_by_host():
    ok = evaluate([result(0, 0.010), result(1, 0.015)], slow_factor=2.0)
    assert ok.ok and ok.failed == () and ok.slow == () and ok.median_compute_s == 0.010

    # with two ranks the lower median is the fast one, so the slow one stands out
    slow = evaluate([result(1, 0.050, "node-b"), result(0, 0.010)], slow_factor=2.0)
    assert not slow.ok and slow.slow == (1,) and slow.failed == ()
    assert slow.bad_hosts() == ["node-b"]
    assert "node-b rank 1 (local rank 1): compute took 0.0500 s, 5.0x the median 0.0100 s" in slow.summary()

    failed = evaluate([result(0, 0.01), result(1, None, "node-b", "RuntimeError: boom"), result(2, 0.011)])
    assert failed.failed == (1,) and failed.slow == ()
    assert "node-b rank 1 (local rank 1): RuntimeError: boom" in failed.summary()
    assert NodeCheckReport.from_json(json.loads(json.dumps(failed.to_json()))) == failed


def test_registry_prefers_the_last_registered_available_check(registry):
    class Unavailable(NodeCheck):
        name = "test-unavailable"

        def available(self) -> bool:
            return False

        def run(self, device_index: int) -> float:
            raise AssertionError("never run")

    class Mine(CpuNodeCheck):
        name = "test-mine"

    assert register_node_check(Mine) is Mine  # usable as a decorator
    register_node_check(Unavailable())
    assert node_check.registered_node_checks()[:2] == ["test-unavailable", "test-mine"]
    assert select_node_check().name == "test-mine"
    assert select_node_check("cpu").name == "cpu"
    assert select_node_check("cpu").run(0) > 0
    with pytest.raises(NodeCheckError, match="not available"):
        select_node_check("test-unavailable")
    with pytest.raises(NodeCheckError, match="No node check is registered as 'nope'"):
        select_node_check("nope")
    with pytest.raises(TypeError):
        register_node_check(object())


def test_entry_point_plugins_are_registered(registry, tmp_path, monkeypatch):
    dist_info = tmp_path / "fake_node_check_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-node-check-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{node_check.ENTRY_POINT_GROUP}]\nmine = tests.launcher.node_check_plugins:EntryPointCheck\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    node_check.load_node_check_plugins()
    assert "test-entry-point" in node_check.registered_node_checks()


def test_node_check_error_is_a_flashckpt_error():
    assert issubclass(NodeCheckError, FlashCkptError)
    assert NodeCheckError("x", report="r").report == "r"


def launch_config():
    """The LaunchConfig torchrun would build for `--standalone --nproc-per-node=2`."""
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node=2", "unused.py"])
    args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"  # what torchrun's run() does for --standalone
    config, _, _ = config_from_args(args)
    return config


@pytest.fixture
def worker_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in (knobs.NODE_CHECK_PLUGINS, SLOW_RANK, FAIL_RANK):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.distributed
def test_two_ranks_pass_and_the_report_has_both(worker_env):
    # factor 4 rather than 2: other tests share these 2 cores; the slow test below is 20x+ off
    report = run_node_check(launch_config(), timeout_s=120, slow_factor=4.0, repeats=5)
    assert report.ok and report.failed == () and report.slow == ()
    assert [r.rank for r in report.ranks] == [0, 1]
    assert [r.local_rank for r in report.ranks] == [0, 1]
    for r in report.ranks:
        assert r.hostname == HOST and r.check == "cpu" and r.error is None
        assert r.compute_s > 0 and r.collective_s > 0


@pytest.mark.distributed
def test_run_node_check_names_the_slow_rank_and_keeps_its_report(worker_env, tmp_path):
    worker_env.setenv(knobs.NODE_CHECK_PLUGINS, PLUGINS)
    worker_env.setenv(SLOW_RANK, "1")
    kept = tmp_path / "reports" / "node.json"
    with pytest.raises(NodeCheckError) as caught:
        run_node_check(launch_config(), timeout_s=120, report_path=str(kept))
    report = caught.value.report
    assert NodeCheckReport.from_json(json.loads(kept.read_text())) == report  # kept after the check
    assert report.slow == (1,) and report.failed == ()
    assert {r.check for r in report.ranks} == {"test-faulty-cpu"}
    assert report.ranks[1].compute_s >= 0.3 > report.ranks[0].compute_s
    # the launch's ChildFailedError: the first worker to finish exited 1; one still running then was stopped
    exitcodes = {f.exitcode for f in caught.value.__cause__.failures.values()}
    assert 1 in exitcodes and exitcodes <= {1, -15}
    message = str(caught.value)
    assert f"found problems on {HOST}" in message and f"{HOST} rank 1 (local rank 1): compute took" in message
    assert "rank 0" not in message


@pytest.mark.distributed
def test_worker_under_torchrun_reports_the_failing_rank_and_exits_nonzero(worker_env, tmp_path):
    worker_env.setenv(knobs.NODE_CHECK_PLUGINS, PLUGINS)
    worker_env.setenv(FAIL_RANK, "1")
    report_path = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "-m", "flashckpt_integrations.launcher.node_check", "--report", str(report_path), "--timeout", "120"]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(report_path.read_text())
    assert data["ok"] is False and data["failed_ranks"] == [1] and data["slow_ranks"] == []
    assert data["bad_hosts"] == [HOST]
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[1]["error"] == "RuntimeError: injected failure on rank 1"
    assert ranks[0]["error"] is None and ranks[0]["compute_s"] > 0
    assert ranks[0]["collective_s"] is None  # skipped: not every rank passed
    assert f"{HOST} rank 1 (local rank 1): RuntimeError: injected failure on rank 1" in proc.stdout
