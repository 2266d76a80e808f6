"""examples/megatron/demo.py as a test: Megatron's own pretrain() with the patch on its default checkpoint
format (torch_dist, distributed optimizer, --async-save), killed, resumed from memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.training.checkpointing")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pretrain_example_is_killed_and_resumes_from_memory():
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "megatron", "demo.py")], env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[pretrain_gpt] resumed from iteration 6 (memory)" in proc.stdout
    assert "iter_0000012/ holds Megatron's torch_dist files: .metadata, __0_0.distcp, __1_0.distcp, metadata.json" \
        in proc.stdout
    assert "demo OK" in proc.stdout
