"""accelerate: ``save_state``/``load_state`` through the core, and ``accelerate launch`` of the examples."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from flashckpt_integrations import cli  # noqa: E402
from flashckpt_integrations.adapters.accelerate import AccelerateCheckpointer, enable  # noqa: E402
from flashckpt_integrations.errors import LayoutMismatchError  # noqa: E402
from tests.helpers import save_lines  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples", "hf")
CONFIG = os.path.join(EXAMPLES, "two_processes.yaml")


class Counter:
    """A custom object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _setup(project_dir, *, automatic=True, total_limit=None, seed=0):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        str(project_dir), automatic_checkpoint_naming=automatic, total_limit=total_limit))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def _train(model, optimizer, scheduler, counter, steps):
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1


def _state(model, optimizer):
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        out.update({f"opt.{index}.{k}": v.clone() for k, v in state.items()})
    return out


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_save_state_persists_accelerate_folders_that_stock_load_state_reads(tmp_path):
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "proj", total_limit=2)
    flash = enable(accelerator)
    for _ in range(3):
        _train(model, optimizer, scheduler, counter, 2)
        path = accelerator.save_state()  # automatic naming: checkpoint_0, _1, _2
    flash.wait()
    expected = _state(model, optimizer)
    folders = lambda: sorted(os.listdir(tmp_path / "proj" / "checkpoints"))  # noqa: E731
    assert _wait_for(lambda: folders() == ["checkpoint_1", "checkpoint_2"]), folders()  # total_limit=2, after commit
    assert path == str(tmp_path / "proj" / "checkpoints" / "checkpoint_2")
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(os.listdir(path))
    flash.close()

    # A fresh process state, stock accelerate (no flash adapter), reads the folder.
    stock, model2, optimizer2, scheduler2, counter2 = _setup(tmp_path / "other", automatic=False, seed=1)
    stock.load_state(path)
    _assert_equal(_state(model2, optimizer2), expected)
    assert counter2.count == 6 and scheduler2.state_dict() == scheduler.state_dict()


def test_load_state_prefers_a_newer_memory_snapshot_and_restores_everything(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "proj")
    flash = AccelerateCheckpointer(accelerator)
    _train(model, optimizer, scheduler, counter, 2)
    saves = {2: flash.save_state(2)}
    assert saves[2].wait().committed
    _train(model, optimizer, scheduler, counter, 3)
    saves[5] = flash.save_state(5, persist=False)
    assert saves[5].status.value == "in_memory"
    expected, rng = _state(model, optimizer), torch.get_rng_state()
    _train(model, optimizer, scheduler, counter, 2)  # progress that a crash would lose

    assert flash.load_state() == (5, "memory")
    _assert_equal(_state(model, optimizer), expected)
    assert counter.count == 5 and scheduler.scheduler.last_epoch == 5
    assert torch.equal(torch.get_rng_state(), rng)
    assert accelerator.project_configuration.iteration == 6
    saves[8] = flash.save_state(8, persist=False)
    assert saves[8].ok  # the two slots now hold steps 5 and 8
    assert flash.load_state(2) == (2, "storage")  # an explicit step that only storage holds
    assert counter.count == 2
    flash.close()
    # One INFO line per save: its real folder (or memory only) and the whole time it held training.
    messages = [r.getMessage() for r in caplog.records]
    lines = save_lines(messages, "accelerate save_state")
    assert [(rank, step, status) for rank, step, status, _, _ in lines] == [
        (0, 2, "persisting"), (0, 5, "in_memory"), (0, 8, "in_memory")], messages
    assert lines[0][3] == f"to {tmp_path / 'proj' / 'checkpoints' / 'checkpoint_2'}"
    assert lines[1][3] == lines[2][3] == "(memory only, not persisted)"
    for _, step, _, _, held in lines:
        assert held + 0.0005 >= saves[step].blocking_s, (step, held, saves[step].blocking_s)
    assert not [m for m in messages if "flashckpt-files" in m or "flashckpt-memory" in m], messages


def test_a_resume_from_storage_is_still_found_by_the_restart_after_it(tmp_path):
    """Run 1 commits step 2. Run 2 resumes it from storage (its memory is gone), takes a memory-only
    snapshot and dies, its memory lost too; run 3 must still find step 2 (run 2 continued its lineage)."""
    project = tmp_path / "proj"
    accelerator, model, optimizer, scheduler, counter = _setup(project)
    flash = AccelerateCheckpointer(accelerator)
    _train(model, optimizer, scheduler, counter, 2)
    assert flash.save_state(2).wait().committed
    flash.close()  # frees the shared memory: the next run resumes from storage
    for run in (2, 3):
        accelerator, model, optimizer, scheduler, counter = _setup(project, seed=run)
        flash = AccelerateCheckpointer(accelerator)
        assert flash.load_state() == (2, "storage"), run
        assert counter.count == 2
        _train(model, optimizer, scheduler, counter, 1)
        assert flash.save_state(3, persist=False).ok
        flash.close()  # the memory-only snapshot is lost, as in a crash on another node


def test_a_restore_says_where_it_resumed_and_a_loop_that_starts_over_is_warned(tmp_path, caplog):
    """The README's restart line alone (the loop not told where to start) would train steps 1.. again
    on top of the restored state and replace a committed folder: a WARNING says so, at its first save."""
    caplog.set_level(logging.WARNING, logger="flashckpt_integrations")
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "proj")
    flash = enable(accelerator)
    _train(model, optimizer, scheduler, counter, 3)
    assert flash.save_state(3).wait().committed
    _train(model, optimizer, scheduler, counter, 3)
    assert flash.save_state(6, persist=False).ok
    flash.checkpointer.shutdown(clean=False)  # a crash: the memory stays for the restart

    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "proj", seed=1)
    flash = enable(accelerator)
    assert flash.resume_point(4) == (0, 0)  # nothing restored yet
    caplog.clear()
    assert accelerator.load_state() == (6, "memory")
    snapshot_folder = tmp_path / "proj" / "checkpoints" / "checkpoint_6"
    assert [r.getMessage() for r in caplog.records] == [
        f"flashckpt: resumed from step 6 (shared memory, the snapshot for {snapshot_folder}); the next save should "
        "be of a later step"]
    assert flash.resumed_folder == "checkpoints/checkpoint_6"
    assert flash.resume_point(4) == (1, 2) and flash.resume_point(2, gradient_accumulation_steps=2) == (6, 0)
    with pytest.raises(ValueError, match="must be at least 1"):
        flash.resume_point(0)
    caplog.clear()
    assert flash.save_state(3).wait().committed  # the loop started over
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "saving step 3 right after restoring step 6" in warning and "resume_point" in warning
    assert f"it replaces the committed {tmp_path / 'proj' / 'checkpoints' / 'checkpoint_3'}" in warning
    caplog.clear()
    assert flash.save_state(4, persist=False).ok  # said once
    assert accelerator.load_state() == (4, "memory")
    caplog.clear()
    assert flash.save_state(5, persist=False).ok  # a loop that starts after the restored step: no warning
    assert caplog.records == []
    flash.close()


def test_save_state_into_the_scripts_own_folders_and_load_state_from_them_or_another_runs(tmp_path):
    """accelerate's examples save to ``<output_dir>/step_<N>`` (or ``epoch_<N>``) and resume with
    ``load_state(<that folder>)``; a checkpoint of another run loads into a new output dir."""
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "p1", automatic=False)
    out = tmp_path / "out"
    flash = enable(accelerator, out)
    _train(model, optimizer, scheduler, counter, 2)
    assert accelerator.save_state(str(out / "step_2")) == str(out / "step_2")
    assert flash.wait().committed
    expected = _state(model, optimizer)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= set(
        os.listdir(out / "step_2"))
    _train(model, optimizer, scheduler, counter, 2)
    assert accelerator.save_state(str(out / "runs" / "epoch_4")) == str(out / "runs" / "epoch_4")
    assert flash.wait().committed and (out / "runs" / "epoch_4" / "model.safetensors").exists()
    assert not (out / "checkpoint_2").exists() and not (out / "checkpoint_4").exists()

    assert accelerator.load_state(str(out / "step_2")) == (2, "memory")  # the script's own resume line
    _assert_equal(_state(model, optimizer), expected)
    assert counter.count == 2
    flash.close()

    other, model, optimizer, scheduler, counter = _setup(tmp_path / "p2", automatic=False, seed=1)
    enable(other, tmp_path / "new-output")  # a new run, another output dir: the old folder goes to the stock loader
    assert other.load_state(str(out / "step_2")) is None
    _assert_equal(_state(model, optimizer), expected)
    assert counter.count == 2


def test_a_folder_that_is_not_a_flash_checkpoint_is_saved_by_the_stock_code_and_said_so(tmp_path, caplog):
    """``save_state("best")`` or a folder elsewhere: no step in the name, so the stock save_state writes it
    (synchronously, said in a WARNING); ``load_state`` of it is the stock loader's, and gets it back."""
    caplog.set_level(logging.WARNING, logger="flashckpt_integrations")
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "proj", automatic=False)
    flash = enable(accelerator, tmp_path / "ckpt")
    _train(model, optimizer, scheduler, counter, 2)
    expected = _state(model, optimizer)
    for path in (tmp_path / "ckpt" / "best", tmp_path / "somewhere" / "else"):
        caplog.clear()
        accelerator.save_state(str(path))
        assert {"model.safetensors", "optimizer.bin", "scheduler.bin"} <= set(os.listdir(path))
        (warning,) = [r.getMessage() for r in caplog.records]
        assert "is not a flash checkpoint" in warning and "stock save_state" in warning
    _train(model, optimizer, scheduler, counter, 2)
    accelerator.load_state(str(tmp_path / "somewhere" / "else"))
    _assert_equal(_state(model, optimizer), expected)
    assert flash.checkpointer.committed_steps() == []  # nothing of it went through the core
    flash.close()

    # with automatic naming the stock save_state ignores the path: the next automatic checkpoint
    accelerator, model, optimizer, scheduler, counter = _setup(tmp_path / "auto")
    flash = enable(accelerator)
    caplog.clear()
    assert accelerator.save_state(str(tmp_path / "auto" / "best")).endswith("checkpoint_0")
    assert "accelerate ignores the path" in caplog.records[0].getMessage()
    flash.wait()
    assert os.listdir(tmp_path / "auto" / "checkpoints") == ["checkpoint_0"]
    flash.close()


def test_bad_input_is_refused_with_what_to_do(tmp_path):
    accelerator, model, *_ = _setup(tmp_path / "proj")
    with pytest.raises(ValueError, match="leave checkpoint_dir out"):
        AccelerateCheckpointer(accelerator, tmp_path / "elsewhere")
    flash = enable(accelerator)
    flash.save_state(1, persist=False)
    saved = accelerator._models[0]
    accelerator._models[0] = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.raises(LayoutMismatchError, match=r"0.weight: saved \(16, 8\), model \(32, 8\)"):
        flash.load_state(1)
    accelerator._models[0] = saved
    accelerator._models.append(torch.nn.Linear(3, 3))
    with pytest.raises(LayoutMismatchError, match="no weights for model 1"):
        flash.load_state(1)
    accelerator._models.pop()
    flash.close()

    plain, *_ = _setup(tmp_path / "plain", automatic=False)
    with pytest.raises(ValueError, match="pass checkpoint_dir"):
        AccelerateCheckpointer(plain)
    with pytest.raises(ValueError, match="needs the step"):
        AccelerateCheckpointer(plain, tmp_path / "ck").save_state()


# --- accelerate launch, 2 processes ------------------------------------------------------------


def _launch(script: str, *args: str, timeout: float = 240, config: str = CONFIG, processes: int | None = None
            ) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
           "--main_process_port", str(_free_port()), *(["--num_processes", str(processes)] if processes else []),
           os.path.join(EXAMPLES, script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{") and '"final_step"' in x]
    return proc, (lines[-1] if lines else None)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_accelerate_launch_trainer_example_crashes_and_resumes_from_memory(tmp_path, private_shm_dir):
    out = str(tmp_path / "run")
    steps = ("--max-steps", "14", "--save-steps", "5", "--memory-interval", "3")
    crashed, _ = _launch("train.py", "--output-dir", out, "--crash-at", "12", *steps)
    assert crashed.returncode != 0 and '{"crashing_at": 12}' in crashed.stdout, crashed.stdout + crashed.stderr
    assert _wait_for(lambda: sorted(os.listdir(out)) == [".flashckpt", "checkpoint-10", "checkpoint-5"])

    resumed, summary = _launch("train.py", "--output-dir", out, "--params-out", str(tmp_path / "run.pt"), *steps)
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert summary["world_size"] == 2 and summary["final_step"] == 14, logs
    assert summary["resumed_from"] == [12, "memory"], logs
    assert logs.count("resuming from the shared-memory snapshot of step 12") == 2, logs  # both processes
    assert _wait_for(lambda: sorted(os.listdir(out)) == [".flashckpt", "checkpoint-10", "checkpoint-14"]), logs

    reference, ref = _launch("train.py", "--output-dir", str(tmp_path / "ref"), "--plain",
                             "--params-out", str(tmp_path / "ref.pt"), *steps)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert ref["world_size"] == 2
    assert summary["params_sha256"] == ref["params_sha256"]
    _assert_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt"))


STOCK_LOAD = """
import sys, torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel
sys.modules["flashckpt_integrations"] = None  # the stock loader alone
acc = Accelerator(cpu=True)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
model, opt, sched = acc.prepare(model, opt, sched)
acc.load_state(sys.argv[1])
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
print(sched.scheduler.last_epoch)
"""


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_accelerate_launch_loop_example_crashes_resumes_and_stock_accelerate_loads_it(tmp_path, private_shm_dir):
    project = str(tmp_path / "run")
    crashed, _ = _launch("accelerate_loop.py", "--project-dir", project, "--crash-at", "12")
    assert crashed.returncode != 0 and '{"crashing_at": 12}' in crashed.stdout, crashed.stdout + crashed.stderr
    assert _wait_for(lambda: sorted(os.listdir(os.path.join(project, "checkpoints"))) ==
                     ["checkpoint_10", "checkpoint_5"])

    resumed, summary = _launch("accelerate_loop.py", "--project-dir", project,
                               "--params-out", str(tmp_path / "run.pt"))
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert summary["resumed_from"] == [12, "memory"] and summary["world_size"] == 2, logs
    assert _wait_for(lambda: sorted(os.listdir(os.path.join(project, "checkpoints"))) ==
                     ["checkpoint_15", "checkpoint_20"]), logs  # total_limit=2, applied after each commit

    reference, ref = _launch("accelerate_loop.py", "--project-dir", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert ref["resumed_from"] is None and summary["params_sha256"] == ref["params_sha256"]

    stock = subprocess.run([sys.executable, "-c", STOCK_LOAD, os.path.join(project, "checkpoints", "checkpoint_20"),
                            str(tmp_path / "stock.pt")], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert stock.returncode == 0, stock.stdout + stock.stderr
    assert stock.stdout.split()[-1] == "40"  # the scheduler steps once per process and step under accelerate
    final = torch.load(tmp_path / "run.pt")
    loaded = torch.load(tmp_path / "stock.pt")
    _assert_equal({k: loaded[k] for k in final}, final)


LAUNCH_SETTINGS = """machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
"""What every accelerate config file of these tests ends with: 2 processes on this machine."""
FSDP_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: {version}
  fsdp_state_dict_type: {kind}
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: GPT2Block
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
{version_options}""" + LAUNCH_SETTINGS
SHARDED_SCRIPT = os.path.join(REPO, "tests", "hf", "accelerate_sharded_script.py")


DEEPSPEED_CONFIG = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: {stage}
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: false
distributed_type: DEEPSPEED
""" + LAUNCH_SETTINGS


def _crash_resume_and_compare(tmp_path, config_text: str) -> list[str]:
    """A crash right after the memory snapshot of step 6 (committed: step_4), a relaunch that resumes from
    memory and trains to step 8; the stock accelerate, in processes that never import us, resumes from our
    step_4 folder and trains to step 8: the same parameters, bit for bit (each step's batch depends only on
    the step). Returns the files of step_4."""
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    out = str(tmp_path / "run")
    crashed, _ = _launch(SHARDED_SCRIPT, "--out", out, "--crash-at", "6", config=str(config))
    assert crashed.returncode != 0 and '{"crashing_at": 6}' in crashed.stdout, crashed.stdout + crashed.stderr
    assert _wait_for(lambda: "step_4" in os.listdir(out))
    files = sorted(os.path.relpath(os.path.join(d, f), os.path.join(out, "step_4")).replace(os.sep, "/")
                   for d, _, names in os.walk(os.path.join(out, "step_4")) for f in names)

    resumed, summary = _launch(SHARDED_SCRIPT, "--out", out, "--params-out", str(tmp_path / "run.pt"),
                               config=str(config))
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert summary["resumed_from"] == [6, "memory"] and summary["flash"], logs
    assert _wait_for(lambda: "step_8" in os.listdir(out)), logs

    stock, ref = _launch(SHARDED_SCRIPT, "--out", str(tmp_path / "stock"), "--plain", "--resume-from",
                         os.path.join(out, "step_4"), "--params-out", str(tmp_path / "stock.pt"), config=str(config))
    assert stock.returncode == 0, stock.stdout + stock.stderr
    assert ref["resumed_from"] == [4, "storage"] and not ref["flash"]
    assert summary["params_sha256"] == ref["params_sha256"]
    _assert_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "stock.pt"))
    return files


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version,kind", [(2, "SHARDED_STATE_DICT"), (2, "FULL_STATE_DICT"), (1, "SHARDED_STATE_DICT")])
def test_accelerate_launch_fsdp_crash_resumes_from_memory_as_stock_resumes_from_our_folder(tmp_path, private_shm_dir,
                                                                                           version, kind):
    """FSDP from an ``accelerate launch`` config file, 2 processes (see :func:`_crash_resume_and_compare`)."""
    options = ("  fsdp_reshard_after_forward: true\n" if version == 2 else  # (no sync_module_states on a CPU)
               "  fsdp_reshard_after_forward: FULL_SHARD\n  fsdp_sync_module_states: false\n"
               "  fsdp_use_orig_params: true\n")
    files = _crash_resume_and_compare(tmp_path, FSDP_CONFIG.format(version=version, kind=kind,
                                                                   version_options=options))
    fsdp_files = ({"optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp",
                   "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                   "pytorch_model_fsdp_0/__1_0.distcp"} if kind == "SHARDED_STATE_DICT"
                  else {"optimizer.bin", "pytorch_model_fsdp.bin"})
    assert set(files) == fsdp_files | {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}, files


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_accelerate_launch_fsdp_resumes_from_the_memory_of_more_processes(tmp_path, private_shm_dir, capsys):
    """FSDP2's sharded state saved by 4 processes, killed right after the memory-only snapshot of step 9
    (committed: step_8); the node persists step 9 from the 4 processes' memory (the storage reference).
    2 processes resume step 9 from that memory and train to step 12, bit for bit as the stock accelerate
    on 2 processes does from the persisted folder."""
    config = tmp_path / "config.yaml"
    config.write_text(FSDP_CONFIG.format(version=2, kind="SHARDED_STATE_DICT",
                                         version_options="  fsdp_reshard_after_forward: true\n"))
    out = str(tmp_path / "run")
    crashed, _ = _launch(SHARDED_SCRIPT, "--out", out, "--steps", "12", "--crash-at", "9", config=str(config),
                         processes=4)
    assert crashed.returncode != 0 and '{"crashing_at": 9}' in crashed.stdout, crashed.stdout + crashed.stderr
    capsys.readouterr()
    assert cli.main(["persist", out, "--shm-dir", private_shm_dir]) == 0
    assert "step 9 is committed (ranks [0, 1, 2, 3]" in capsys.readouterr().out
    resumed, summary = _launch(SHARDED_SCRIPT, "--out", out, "--steps", "12", "--params-out", str(tmp_path / "run.pt"),
                               config=str(config))
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, logs
    assert summary["resumed_from"] == [9, "memory"] and summary["flash"], logs
    assert "step 9 was saved by 4 processes and is resharded onto 2 from their memory" in logs
    persisted = [name for name in os.listdir(out) if name.endswith("9")]
    assert len(persisted) == 1, os.listdir(out)
    stock, ref = _launch(SHARDED_SCRIPT, "--out", str(tmp_path / "stock"), "--plain", "--resume-from",
                         os.path.join(out, persisted[0]), "--steps", "12", "--params-out", str(tmp_path / "stock.pt"),
                         config=str(config))
    assert stock.returncode == 0, stock.stdout + stock.stderr
    assert ref["resumed_from"] == [9, "storage"]
    _assert_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "stock.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_deepspeed_crash_resumes_from_memory_as_stock_resumes_from_our_folder(
        tmp_path, private_shm_dir, stage):
    """DeepSpeed ZeRO-2/3 from an ``accelerate launch`` config file, 2 processes (see
    :func:`_crash_resume_and_compare`); the folders hold DeepSpeed's own layout under accelerate's tag."""
    files = _crash_resume_and_compare(tmp_path, DEEPSPEED_CONFIG.format(stage=stage))
    model_states = (["pytorch_model/mp_rank_00_model_states.pt"] if stage == 2 else
                    [f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
    expected = {"latest", "zero_to_fp32.py", "random_states_0.pkl", "random_states_1.pkl", *model_states,
                *[f"pytorch_model/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]}
    assert expected <= set(files), files
    assert (tmp_path / "run" / "step_4" / "latest").read_text() == "pytorch_model"


def test_missing_accelerate_names_the_extra():
    code = ("import sys; sys.modules['accelerate'] = None\n"
            "try:\n    import flashckpt_integrations.adapters.accelerate\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert "pip install 'flashckpt-integrations[accelerate]'" in out.stdout, out.stdout + out.stderr
