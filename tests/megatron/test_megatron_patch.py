"""The Megatron-LM patch against Megatron's real save_checkpoint / load_checkpoint (2 CPU ranks, gloo).

These run in the Python >= 3.12 environment of ``scripts/test-megatron.sh``; elsewhere they skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training.checkpointing")

import torch  # noqa: E402

from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRACKER = "latest_checkpointed_iteration.txt"


def launch(mode: str, layout: str, ckpt, out, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    cmd = [*torchrun_cmd(2, free_port()), os.path.join(HERE, "worker.py"), "--layout", layout, "--ckpt", str(ckpt),
           "--out", str(out), "--mode", mode]
    environ = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "PYTHONWARNINGS": "ignore", **env}
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout)


def records(out) -> list[dict]:
    result = []
    for rank in range(2):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            result.append(json.load(f))
    return result


def checked(proc: subprocess.CompletedProcess, out) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs = records(out)
    for rec in recs:
        assert "error" not in rec, rec.get("traceback")
    return recs


def files_of(step_dir) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, n), step_dir) for root, _, names in os.walk(step_dir)
                  for n in names)


EXPECTED_FILES = {
    "tp2": ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"],
    "pp2": ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
    "dp2": ["mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"],
    "ep2": ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
}


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory):
    """Run each layout's round trip once; the tests below read the results."""
    done = {}

    def run(layout: str, **env: str):
        if layout not in done:
            base = tmp_path_factory.mktemp(f"megatron-{layout}")
            proc = launch("roundtrip", layout, base / "ckpt", base / "out", **env)
            done[layout] = (base / "ckpt", checked(proc, base / "out"))
        return done[layout]

    return run


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "ep2"])
def test_patched_save_is_loaded_by_stock_megatron_and_training_continues_bit_exact(roundtrips, layout):
    ckpt, recs = roundtrips(layout)
    for rec in recs:
        assert rec["status"] == {"1": "in_memory", "2": "persisting", "3": "in_memory", "4": "persisting"}
        assert rec["committed"] == [4, True, None]
        assert rec["loaded_iteration"] == 4 and rec["loaded_flops"] == 400
        assert rec["loaded"] == rec["saved"], "stock load_checkpoint restored other model or optimizer state"
        assert rec["final"] == rec["reference"], "training after the load differs from the uninterrupted run"
    # Megatron's own layout, written by the saver, with the tracker naming the newest commit
    assert (ckpt / TRACKER).read_text() == "4"
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    assert files_of(ckpt / "iter_0000004") == EXPECTED_FILES[layout]
    state = torch.load(ckpt / "iter_0000004" / EXPECTED_FILES[layout][-1], map_location="cpu", weights_only=False)
    assert state["iteration"] == 4 and state["args"].save == str(ckpt)


def test_kill_after_a_memory_snapshot_resumes_from_memory_without_reading_storage(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    crashed = launch("crash", "dp2", ckpt, out)
    assert crashed.returncode != 0, "the crash run should have been killed"
    assert (ckpt / TRACKER).read_text() == "4"  # 5 and 6 were memory-only snapshots
    before = [json.loads((ckpt / f"crash-{r}.json").read_text()) for r in range(2)]
    shutil.rmtree(ckpt / "iter_0000004")  # storage holds nothing readable: a load from it would fail
    recs = checked(launch("resume", "dp2", ckpt, out), out)
    for rec, old in zip(recs, before):
        assert rec["source"] == [6, "memory"]
        assert rec["loaded_iteration"] == 6 and rec["loaded_flops"] == 600
        assert rec["loaded"] == old["saved"]
        assert rec["final"] == old["reference"]


def test_tracker_never_names_an_iteration_whose_files_are_incomplete(tmp_path):
    # The saver is killed in the middle of writing iteration 2's files; the ranks restart it and ask again.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    recs = checked(launch("roundtrip", "tp2", ckpt, out, SAVER_FAULT="saver.write@1"), out)
    for rec in recs:
        assert rec["final"] == rec["reference"] and rec["loaded_iteration"] == 4
    named = int((ckpt / TRACKER).read_text())
    for name in sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")):
        assert files_of(ckpt / name) == EXPECTED_FILES["tp2"], f"{name} is incomplete but in place"
        for rel in EXPECTED_FILES["tp2"]:
            torch.load(ckpt / name / rel, map_location="cpu", weights_only=False)
    assert named == 4
    staging = ckpt / ".flashckpt" / "staging"
    assert not staging.exists() or not os.listdir(staging)


def test_load_with_other_parallel_sizes_names_the_sizes_that_differ(roundtrips, tmp_path):
    ckpt, _ = roundtrips("tp2")
    recs = records_of(launch("load", "dp2plain", ckpt, tmp_path / "out"), tmp_path / "out")
    for rec in recs:
        assert "LayoutMismatchError" in rec["error"]
        assert "tensor_model_parallel_size 2 (this run 1)" in rec["error"]
        assert "pipeline_model_parallel_size" not in rec["error"]


def records_of(proc: subprocess.CompletedProcess, out) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return records(out)


def test_patch_refuses_an_unsupported_megatron_version(monkeypatch):
    from flashckpt_integrations.adapters import megatron as flash_megatron
    from flashckpt_integrations.errors import FlashCkptError

    monkeypatch.setattr(flash_megatron._package_info, "__version__", "0.14.0")
    with pytest.raises(FlashCkptError, match=r"megatron-core 0.14.0 is not supported.*supported releases: 0.19.x"):
        flash_megatron.patch()
    assert flash_megatron._active is None


def test_patch_rejects_bad_options():
    from flashckpt_integrations.adapters import megatron as flash_megatron

    with pytest.raises(ValueError, match="persist_interval=0"):
        flash_megatron.patch(persist_interval=0)
    with pytest.raises(ValueError, match="must not set 'layout'"):
        flash_megatron.patch(config={"layout": None})
    checkpointing = sys.modules["megatron.training.checkpointing"]
    assert checkpointing.save_checkpoint is flash_megatron._checkpointing.save_checkpoint
    assert flash_megatron._active is None


def test_dist_checkpointing_save_through_the_flash_strategy_loads_with_the_stock_loader(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    recs = checked(launch("dist", "tp2", ckpt, out), out)
    for rec in recs:
        assert rec["committed"] == [2, True, None]
        assert rec["loaded"] == rec["saved"]
    assert recs[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    assert (ckpt / ".flashckpt" / "steps" / "2" / "COMMITTED").exists()


def test_the_strategy_needs_a_step_in_the_directory_name():
    from flashckpt_integrations.adapters.megatron_core import step_layout

    assert step_layout("/c/iter_0000100")[1:] == (100, step_layout("/c/iter_0000100")[2])
    assert step_layout("/c/iter_0000100")[2].step_path(7) == "iter_0000007"
    assert step_layout("/c/step-12")[2].step_path(7) == "step-7"
    with pytest.raises(ValueError, match="does not end in a step number"):
        step_layout("/c/latest")
