"""FlashCkptTrainer under FSDP (2 gloo ranks, FSDP forced on CPU): accelerate's files through the core.

Each test runs, under torchrun: the stock Trainer uninterrupted (the reference, beside the rest); a
FlashCkptTrainer run whose rank 0 is killed right after a memory-only snapshot; a restart that resumes
from shared memory, followed in the same processes by a stock Trainer that resumes from a checkpoint
the saver wrote. Both must end bit for bit where the reference did.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flashckpt_integrations import cli  # noqa: E402
from tests.distributed.launch import free_port, torchrun_cmd  # noqa: E402
from tests.hf.common import assert_bitwise_equal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "fsdp_script.py")


def _env() -> dict[str, str]:
    # OMP_NUM_THREADS=1: every run computes in the same order, so results compare bit for bit.
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def _script(out, result, *extra: str, nproc: int = 2) -> list[str]:
    return [*torchrun_cmd(nproc, free_port()), SCRIPT, "--out", str(out), "--result", str(result), *extra]


def _summary(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"')][-1])


def checkpoints(output_dir) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(output_dir) if n.startswith("checkpoint-"))


def _files(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix: value}


def assert_same_state(a, b) -> None:
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_b[key]), key
        else:
            assert value == flat_b[key], key


def _read_dcp(folder, scratch) -> dict:
    """A DCP folder read by torch's own reader (no flashckpt code)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, scratch)
    return torch.load(scratch, weights_only=False)


def _crash_and_resume(tmp_path, steps: tuple[str, ...], kill_at: int, resume_stock_from: int, committed: list[int],
                      crash_options: tuple[str, ...] = ()):
    """Reference (stock), crashed run, restart from memory + stock resume; returns the restart's logs."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    reference = subprocess.Popen(_script(ref, tmp_path / "ref.pt", "--plain", *steps), env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed = subprocess.run(_script(run, tmp_path / "run.pt", "--kill-at", str(kill_at), *steps, *crash_options),
                             env=_env(), capture_output=True, text=True, timeout=180)
    assert crashed.returncode != 0 and f'{{"killing_at": {kill_at}}}' in crashed.stdout, \
        crashed.stdout + crashed.stderr
    deadline = time.monotonic() + 30  # the saver finishes a commit that was in flight
    while checkpoints(run) != committed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoints(run) == committed, crashed.stdout + crashed.stderr
    resumed = subprocess.run(
        _script(run, tmp_path / "run.pt", "--resume", *steps, "--then-stock-resume-from",
                str(run / f"checkpoint-{resume_stock_from}"), "--stock-out", str(tmp_path / "stock"),
                "--stock-result", str(tmp_path / "stock.pt")),
        env=_env(), capture_output=True, text=True, timeout=180)
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    out, _ = reference.communicate(timeout=180)
    assert reference.returncode == 0, out
    assert _summary(resumed.stdout) == {"final_step": int(steps[1]), "resumed_from": [kill_at, "memory"],
                                        "model": "FSDPGPT2LMHeadModel", "stock_final_step": int(steps[1])}, logs
    assert resumed.stderr.count(f"resuming from the shared-memory snapshot of step {kill_at}") == 2, logs
    # From memory, and by the stock Trainer from the saver's checkpoint: bit for bit the uninterrupted run.
    reference_params = torch.load(tmp_path / "ref.pt")
    assert_bitwise_equal(torch.load(tmp_path / "run.pt"), reference_params)
    assert_bitwise_equal(torch.load(tmp_path / "stock.pt"), reference_params)
    return logs


@pytest.mark.distributed
def test_sharded_state_dict_crash_resumes_from_memory_and_stock_resumes_the_saver_checkpoint(
        tmp_path, private_shm_dir):
    # 8 steps per epoch: checkpoints every 4 steps, memory snapshots every 3; rank 0 killed after step 9.
    # Before the crash the copies into memory overlap the next steps (async_snapshot); after it they block.
    steps = ("--max-steps", "12", "--save-steps", "4", "--memory-interval", "3")
    logs = _crash_and_resume(tmp_path, steps, kill_at=9, resume_stock_from=8, committed=[4, 8],
                             crash_options=("--flash-config", '{"async_snapshot": true}'))
    run, ref = tmp_path / "run", tmp_path / "ref"
    assert checkpoints(run) == checkpoints(ref) == [4, 8, 12], logs  # no checkpoint-9 was ever written
    for step in (8, 12):
        ours, theirs = run / f"checkpoint-{step}", ref / f"checkpoint-{step}"
        assert _files(ours) == _files(theirs) == [
            "optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
            "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
            "pytorch_model_fsdp_0/__1_0.distcp", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
            "trainer_state.json"]
        for name in ("trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        for folder, key in (("pytorch_model_fsdp_0", "model"), ("optimizer_0", "optimizer")):
            saved = _read_dcp(ours / folder, tmp_path / f"ours-{step}-{folder}.pt")
            assert_same_state(saved, _read_dcp(theirs / folder, tmp_path / f"theirs-{step}-{folder}.pt"))
            assert list(saved) == [key]
    assert os.listdir(private_shm_dir) == []  # a clean end frees the shared memory


@pytest.mark.distributed
def test_sharded_state_dict_resumes_from_memory_on_fewer_ranks(tmp_path, private_shm_dir, capsys):
    """4 ranks, rank 0 killed after the memory-only snapshot of step 9 (commits: 4, 8); the job comes back
    with 2 ranks. The node persists step 9 from the old ranks' slots (``flashckpt persist``: the storage
    reference). The 2 ranks resume step 9 from the memory of the 4, then, in the same processes, a stock
    Trainer on 2 ranks resumes from the committed checkpoint-9 (DCP resharding from storage): both end
    bit for bit alike."""
    run = tmp_path / "run"
    steps = ("--max-steps", "12", "--save-steps", "4", "--memory-interval", "3")
    crashed = subprocess.run(_script(run, tmp_path / "run.pt", "--kill-at", "9", *steps, nproc=4), env=_env(),
                             capture_output=True, text=True, timeout=240)
    assert crashed.returncode != 0 and '{"killing_at": 9}' in crashed.stdout, crashed.stdout + crashed.stderr
    deadline = time.monotonic() + 30
    while checkpoints(run) != [4, 8] and time.monotonic() < deadline:
        time.sleep(0.05)
    capsys.readouterr()
    assert cli.main(["persist", str(run), "--shm-dir", private_shm_dir]) == 0
    assert "step 9 is committed (ranks [0, 1, 2, 3]" in capsys.readouterr().out
    resumed = subprocess.run(
        _script(run, tmp_path / "run.pt", "--resume", *steps, "--then-stock-resume-from", str(run / "checkpoint-9"),
                "--stock-out", str(tmp_path / "stock"), "--stock-result", str(tmp_path / "stock.pt")),
        env=_env(), capture_output=True, text=True, timeout=240)
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert _summary(resumed.stdout) == {"final_step": 12, "resumed_from": [9, "memory"],
                                        "model": "FSDPGPT2LMHeadModel", "stock_final_step": 12}, logs
    assert "resuming from the shared-memory snapshot of step 9, saved by 4 ranks, onto 2 ranks" in logs
    assert "the per-rank files of old ranks 2-3 (rng_state_3.pth ...) are not restored" in logs
    assert_bitwise_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "stock.pt"))


@pytest.mark.distributed
def test_full_state_dict_crash_resumes_from_memory_and_stock_resumes_the_saver_checkpoint(
        tmp_path, private_shm_dir):
    # Rank 0 gathers the state: checkpoints every 4 steps, memory snapshots every 3; rank 0 killed after step 6.
    steps = ("--max-steps", "8", "--save-steps", "4", "--memory-interval", "3",
             "--state-dict-type", "FULL_STATE_DICT")
    logs = _crash_and_resume(tmp_path, steps, kill_at=6, resume_stock_from=4, committed=[4])
    run, ref = tmp_path / "run", tmp_path / "ref"
    assert checkpoints(run) == checkpoints(ref) == [4, 8], logs
    for step in (4, 8):
        ours, theirs = run / f"checkpoint-{step}", ref / f"checkpoint-{step}"
        assert _files(ours) == _files(theirs) == [
            "config.json", "generation_config.json", "model.safetensors", "optimizer.bin", "pytorch_model_fsdp.bin",
            "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json", "training_args.bin"]
        for name in ("trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "config.json"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        assert_bitwise_equal(load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors"))
        for name in ("pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.pt"):
            assert_same_state(torch.load(ours / name, weights_only=True), torch.load(theirs / name, weights_only=True))
    assert os.listdir(private_shm_dir) == []


@pytest.mark.distributed
def test_fsdp1_full_state_dict_crash_resumes_from_memory_bit_exact(tmp_path, private_shm_dir):
    # FSDP1's full state dict is gathered without CPU offload (the stock save offloads and crashes on CPU), so
    # the reference is the stock Trainer with FSDP1's sharded checkpoints: the same training.
    steps = ("--max-steps", "8", "--save-steps", "4", "--memory-interval", "3", "--fsdp-version", "1")
    reference = subprocess.Popen(_script(tmp_path / "ref", tmp_path / "ref.pt", "--plain", *steps), env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    full = ("--state-dict-type", "FULL_STATE_DICT")
    crashed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--kill-at", "6", *steps, *full),
                             env=_env(), capture_output=True, text=True, timeout=180)
    assert crashed.returncode != 0 and '{"killing_at": 6}' in crashed.stdout, crashed.stdout + crashed.stderr
    resumed = subprocess.run(_script(tmp_path / "run", tmp_path / "run.pt", "--resume", *steps, *full),
                             env=_env(), capture_output=True, text=True, timeout=180)
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert _summary(resumed.stdout) == {"final_step": 8, "resumed_from": [6, "memory"],
                                        "model": "FullyShardedDataParallel"}, logs
    out, _ = reference.communicate(timeout=180)
    assert reference.returncode == 0, out
    assert_bitwise_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt"))
    ours = tmp_path / "run" / "checkpoint-8"
    weights = load_file(ours / "model.safetensors")
    assert_bitwise_equal(weights, torch.load(tmp_path / "ref.pt"))
    assert_bitwise_equal(torch.load(ours / "pytorch_model_fsdp.bin", weights_only=True), weights)
    optimizer = torch.load(ours / "optimizer.bin", weights_only=True)
    assert set(optimizer["state"]) == set(weights) - {"lm_head.weight"}  # FQN-keyed; the tied head is the embedding
    assert set(optimizer["state"]["transformer.wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert os.listdir(private_shm_dir) == []
