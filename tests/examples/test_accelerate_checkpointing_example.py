"""``examples/hf/accelerate_checkpointing.py``: a stock accelerate script plus four lines.

The stock script is the example with its ``# flash`` lines taken out. With them, a crash right after a
checkpoint (``step_<N>`` under ``accelerate launch``, 2 processes; ``epoch_<N>``, one process) and a
relaunch without arguments resumes from memory; the stock script, in processes that never import us,
resumes from the same checkpoint's folder with its own parser; both end with the same parameters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "hf", "accelerate_checkpointing.py")
CONFIG = os.path.join(REPO, "examples", "hf", "two_processes.yaml")
FLASH_LINE = re.compile(r"  # flash\b")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(script: str, *args: str, processes: int) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if processes == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
               "--main_process_port", str(_free_port()), script, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{") and '"final_step"' in x]
    return proc, (lines[-1] if lines else None)


def _wait_for(path: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.isdir(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.path.isdir(path)


@pytest.fixture
def stock_script(tmp_path) -> str:
    """The example without its flash lines: exactly four, and nothing of ours is left."""
    lines = open(EXAMPLE).read().splitlines(keepends=True)
    flash = [line for line in lines if FLASH_LINE.search(line)]
    assert len(flash) == 4, flash
    stock = "".join(line for line in lines if not FLASH_LINE.search(line))
    assert "flash" not in re.sub(r'""".*?"""', "", stock, flags=re.S), "the stock script still mentions flash"
    path = tmp_path / "stock_checkpointing.py"
    path.write_text(stock)
    return str(path)


@pytest.mark.parametrize("mode,crash_at,processes,folder", [("4", "8", 2, "step_8"), ("epoch", "1", 1, "epoch_1")])
def test_the_example_resumes_from_memory_as_the_stock_script_resumes_from_the_folder(
        tmp_path, private_shm_dir, stock_script, mode, crash_at, processes, folder):
    out = str(tmp_path / "run")
    crashed, _ = _run(EXAMPLE, "--output_dir", out, "--checkpointing_steps", mode, "--crash_at", crash_at,
                      processes=processes)
    assert crashed.returncode != 0 and f'{{"crashing_at": {crash_at}}}' in crashed.stdout, crashed.stderr[-3000:]
    # the crashed attempt's checkpoint, persisted by the saver after the crash; kept aside (a relaunch that
    # resumed at the wrong place would save that folder again)
    assert _wait_for(os.path.join(out, folder)), os.listdir(out)
    kept = str(tmp_path / "kept" / folder)
    shutil.copytree(os.path.join(out, folder), kept)

    resumed, summary = _run(EXAMPLE, "--output_dir", out, "--checkpointing_steps", mode, processes=processes)
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and summary is not None, logs[-3000:]
    step = int(crash_at)
    resumed_line = f"resumed from step {step} (shared memory, the snapshot for {os.path.join(out, folder)})"
    assert logs.count(resumed_line) == processes, logs[-3000:]
    assert summary["final_step"] == 36 // processes, summary  # 3 epochs of 96 samples in batches of 8 per process

    stock, reference = _run(stock_script, "--output_dir", str(tmp_path / "stock"), "--checkpointing_steps", mode,
                            "--resume_from_checkpoint", kept, processes=processes)
    assert stock.returncode == 0 and reference is not None, (stock.stdout + stock.stderr)[-3000:]
    assert reference["final_step"] == summary["final_step"]
    assert reference["params_sha256"] == summary["params_sha256"]
