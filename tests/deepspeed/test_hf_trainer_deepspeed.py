"""FlashCkptTrainer on the HF Trainer's DeepSpeed path (ZeRO-2, 2 ranks, CPU): checkpoints go through the
flash DeepSpeed engine, ``checkpoint-N/`` holds what the stock Trainer writes, resume from memory after kill -9."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.deepspeed.launch import ds_env  # noqa: E402
from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_ds_script.py")
STOCK_FILES = sorted([
    "config.json", "generation_config.json", "global_step4/mp_rank_00_model_states.pt",
    "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "latest", "model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "training_args.bin",
    "zero_to_fp32.py", "zero_to_torch.py",
])


def run(out, result, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    cmd = torchrun_cmd(2, free_port()) + [SCRIPT, "--out", str(out), "--result", str(result), *extra]
    proc = subprocess.run(cmd, env=ds_env(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"')]
    return proc, json.loads(lines[-1]) if lines else None


def files_of(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names)


def test_deepspeed_checkpoints_resume_from_memory_and_load_in_stock_trainer(tmp_path):
    flash_out = tmp_path / "flash"
    killed, summary = run(flash_out, tmp_path / "unused.pt", "--kill-at", "6")
    assert summary != {"flash": False}, "FlashCkptTrainer fell back to the stock checkpointing"
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert files_of(flash_out / "checkpoint-4") == STOCK_FILES
    assert (flash_out / "checkpoint-4" / "latest").read_text() == "global_step4"
    assert not (flash_out / "checkpoint-6").exists()  # memory only

    resumed, summary = run(flash_out, tmp_path / "resumed.pt", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert summary["resumed_from"] == [6, "memory"] and summary["global_step"] == 8, summary
    assert summary["last_save"] == [8, "persisting"]

    stock, _ = run(tmp_path / "stock", tmp_path / "stock.pt", "--plain")
    assert stock.returncode == 0, stock.stderr[-5000:]
    assert files_of(tmp_path / "stock" / "checkpoint-4") == STOCK_FILES
    reference = torch.load(tmp_path / "stock.pt")
    ours = torch.load(tmp_path / "resumed.pt")
    assert list(ours) == list(reference) and all(torch.equal(ours[k], reference[k]) for k in ours)

    # the stock Trainer (and stock DeepSpeed under it) resumes from the folder the saver wrote
    plain, _ = run(tmp_path / "plain", tmp_path / "plain.pt", "--plain", "--resume-from",
                   str(flash_out / "checkpoint-4"))
    assert plain.returncode == 0, plain.stderr[-5000:]
    theirs = torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(theirs[k], reference[k]) for k in reference)
