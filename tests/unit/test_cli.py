"""The flashckpt command on real checkpoints."""

import json
import os
import subprocess
import sys

import torch


def flashckpt(*args):
    shm = ["--shm-dir", os.environ["FLASHCKPT_SHM_DIR"]]
    return subprocess.run([sys.executable, "-m", "flashckpt_integrations.cli", *shm, *args], capture_output=True,
                          text=True, timeout=120)


def test_ls_inspect_clean(make_checkpointer, tmp_path):
    ckpt = tmp_path / "ckpt"
    ck = make_checkpointer(ckpt)
    assert ck.save(1, {"w": torch.ones(1000)}).wait(60).committed
    ck.save(2, {"w": torch.ones(1000)}, persist=False)

    listing = json.loads(flashckpt("ls", str(ckpt), "--json").stdout)
    assert listing["committed"] == [1]
    assert sorted((m["rank"], m["step"], m["state"]) for m in listing["memory"]) == [(0, 1, "complete"),
                                                                                      (0, 2, "complete")]
    assert "committed steps: 1" in flashckpt("ls", str(ckpt)).stdout

    shown = json.loads(flashckpt("inspect", str(ckpt), "1", "--json").stdout)
    (entry,) = shown["ranks"][0]["files"]
    assert entry["path"] == "rank-0.pt" and entry["size"] == os.path.getsize(ckpt / "step-1" / "rank-0.pt")
    missing = flashckpt("inspect", str(ckpt), "2")
    assert missing.returncode == 1 and "not committed" in missing.stderr

    assert "removed 2" in flashckpt("clean", str(ckpt)).stdout
    assert not any(os.path.exists(p) for p in ck.slot_paths)
