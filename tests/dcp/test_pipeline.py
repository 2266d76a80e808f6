"""Pipeline parallel (torch.distributed.pipelining) through the flash DCP layer: examples/pipeline/pippy_dcp.py.

Each stage rank saves its own stage in one collective save keyed by the unsplit model's names;
the checkpoint loads into 2 stages and into 1, and a crash after a memory snapshot resumes from memory.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dcp.launch import torchrun
from tests.distributed.launch import env

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "pipeline", "pippy_dcp.py")


def pp2(*args) -> subprocess.CompletedProcess:
    return torchrun(os.path.relpath(EXAMPLE, os.path.dirname(os.path.abspath(__file__))), *args)


def pp1(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, EXAMPLE, *map(str, args)], env=env(), capture_output=True, text=True,
                          timeout=120)


def stages(directory, count: int) -> dict:
    """The stages' dumps merged: {"model": {fqn: ...}, "optimizer": {flattened key: ...}}."""
    merged = {"model": {}, "optimizer": {}}
    for rank in range(count):
        dump = torch.load(os.path.join(directory, f"stage-{rank}.pt"), weights_only=True)
        for part in merged:
            assert not set(merged[part]) & set(dump[part])  # no key is saved by two stages
            merged[part].update(dump[part])
    return merged


def report(directory, rank: int = 0) -> dict:
    with open(os.path.join(directory, f"report-{rank}.json")) as f:
        return json.load(f)


def assert_same(a: dict, b: dict) -> None:
    for part in ("model", "optimizer"):
        assert sorted(a[part]) == sorted(b[part]), part
        for key, value in a[part].items():
            other = b[part][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def test_pipeline_crash_resume_and_layout_changes(tmp_path):
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from pippy_dcp import Model
    finally:
        sys.path.remove(os.path.dirname(EXAMPLE))
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    common = ("--steps", 6, "--persist-every", 2, "--memory-every", 1)
    run = pp2("--ckpt", tmp_path / "ref-ckpt", *common, "--dump", tmp_path / "ref")
    assert run.returncode == 0, run.stderr[-3000:]

    run = pp2("--ckpt", ckpt, *common, "--crash-at", 5)  # committed: step 4; in memory only: step 5
    assert run.returncode != 0 and (ckpt / "latest").read_text().strip() == "4"
    run = pp2("--ckpt", ckpt, *common, "--dump", tmp_path / "resumed")
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert report(tmp_path / "resumed", rank)["resumed"] == [5, "memory"]
        assert report(tmp_path / "resumed", rank)["committed"] == [6, True]
    assert_same(stages(tmp_path / "resumed", 2), stages(tmp_path / "ref", 2))

    # one DCP checkpoint keyed by the unsplit model's names (no stage prefix, no per-stage folder)
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(ckpt / "step-6")).read_metadata().state_dict_metadata)
    names = list(Model().state_dict())
    assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in names}
    assert {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")} == set(names)
    assert sorted(os.listdir(ckpt / "step-6")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # PP2 -> PP1: one process loads the 2-stage checkpoint into the whole model
    run = pp1("--ckpt", ckpt, "--load-only", "--dump", tmp_path / "pp1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert report(tmp_path / "pp1")["resumed"] == [6, "storage"]
    assert_same(stages(tmp_path / "pp1", 1), stages(tmp_path / "resumed", 2))

    # PP1 -> PP2: a checkpoint of one process loads into 2 stages
    run = pp1("--ckpt", other, "--steps", 2, "--persist-every", 2, "--memory-every", 1, "--dump", tmp_path / "one")
    assert run.returncode == 0, run.stderr[-3000:]
    run = pp2("--ckpt", other, "--load-only", "--dump", tmp_path / "two")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [report(tmp_path / "two", r)["resumed"] for r in (0, 1)] == [[2, "storage"]] * 2
    assert_same(stages(tmp_path / "two", 2), stages(tmp_path / "one", 1))
