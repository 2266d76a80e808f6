"""Train a tiny GPT-2 with the HuggingFace Trainer and flash checkpoints (CPU, nothing downloaded).

One process, torchrun or accelerate launch::

    python examples/hf/train.py --output-dir /tmp/gpt2-flash
    torchrun --nproc-per-node 2 examples/hf/train.py --output-dir /tmp/gpt2-flash
    accelerate launch --config_file examples/hf/two_processes.yaml examples/hf/train.py --output-dir /tmp/gpt2-flash

The model is a 2-layer GPT-2 built from a config with random weights; the data are the bytes of a
text bundled below (a byte is a token). ``FlashCkptTrainer`` replaces ``Trainer``: every
``--save-steps`` a ``checkpoint-N/`` folder is written by the background saver, and every
``--memory-interval`` steps a snapshot goes to shared memory only. Run it again after a crash
(``--crash-at S`` simulates one with SIGKILL once step S is done) and it resumes
from shared memory. ``--plain`` uses the stock ``Trainer`` for comparison.

At the end the main process prints one JSON line: final step, where it resumed from, the time
each save held training, and the final parameters' checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,  # noqa: E402
)

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402

TEXT = (
    "A checkpoint is a promise to the future: whatever happens to this process, the work done so far "
    "can be picked up again. Writing it should not stop the work it protects. Copy the state into "
    "memory that outlives the process, let another process write it to storage, and commit it only "
    "when every part is safely there. After a crash, start again from memory if it is newer. "
)
SEQ_LEN = 32


class ByteText(torch.utils.data.Dataset):
    """Overlapping windows over the bundled text; each byte is a token (vocabulary of 256)."""

    def __init__(self, repeat: int = 8) -> None:
        data = torch.tensor(list((TEXT * repeat).encode()), dtype=torch.long)
        self.windows = data.unfold(0, SEQ_LEN, SEQ_LEN // 2)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class CrashAfterSnapshot(TrainerCallback):
    """SIGKILL the main process at the start of step S+1, once every process holds step S's snapshot.

    It first waits for checkpoints still being persisted, so that what is on disk at the crash
    does not depend on how fast the machine is.
    """

    def __init__(self, trainer: Trainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if isinstance(self.trainer, FlashCkptTrainer):
                self.trainer.flash_checkpointer.wait()
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            if args.process_index == 0:
                print(json.dumps({"crashing_at": self.step}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def timed(trainer_class: type) -> type:
    """``trainer_class`` that records how long each checkpoint save held training."""

    if hasattr(trainer_class, "_flash_snapshot"):  # the whole snapshot: the save chain and the copy
        class Timed(trainer_class):
            def _flash_snapshot(self, model, persist):
                started = time.perf_counter()
                result = super()._flash_snapshot(model, persist)
                if persist:  # checkpoints only, not the memory-only snapshots between them
                    self.save_seconds = [*getattr(self, "save_seconds", []), time.perf_counter() - started]
                return result
    else:
        class Timed(trainer_class):
            def _save_checkpoint(self, model, trial):
                started = time.perf_counter()
                super()._save_checkpoint(model, trial)
                self.save_seconds = [*getattr(self, "save_seconds", []), time.perf_counter() - started]

    Timed.__name__ = trainer_class.__name__
    return Timed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--save-steps", type=int, default=10, help="persisted checkpoint-N every K steps")
    parser.add_argument("--memory-interval", type=int, default=3, help="memory-only snapshot every K steps")
    parser.add_argument("--save-total-limit", type=int, default=2)
    parser.add_argument("--crash-at", type=int,
                        help="SIGKILL once step S is done (S a multiple of --memory-interval: after its snapshot)")
    parser.add_argument("--plain", action="store_true", help="the stock transformers.Trainer")
    parser.add_argument("--params-out", help="torch.save the final parameters here")
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    set_seed(42)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=SEQ_LEN,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        opts.output_dir, max_steps=opts.max_steps, save_strategy="steps", save_steps=opts.save_steps,
        save_total_limit=opts.save_total_limit, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=5, seed=42, report_to="none", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if opts.plain:
        trainer = timed(Trainer)(model=model, args=args, train_dataset=ByteText())
        has_checkpoint = any(n.startswith("checkpoint-") for n in _listdir(opts.output_dir))
        resume = True if has_checkpoint else None
    else:  # True: memory if newer, else the newest committed checkpoint, else from scratch
        trainer = timed(FlashCkptTrainer)(model=model, args=args, train_dataset=ByteText(),
                                          flash_memory_interval=opts.memory_interval)
        resume = True
    if opts.crash_at is not None:
        trainer.add_callback(CrashAfterSnapshot(trainer, opts.crash_at))
    trainer.train(resume_from_checkpoint=resume)
    if not trainer.is_world_process_zero():
        return
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if opts.params_out:
        torch.save(params, opts.params_out)
    digest = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()[:16]
    print(json.dumps({
        "final_step": trainer.state.global_step,
        "world_size": trainer.args.world_size,
        "resumed_from": getattr(trainer, "flash_resumed_from", None),
        "params_sha256": digest,
        "save_stall_s_median": statistics.median(trainer.save_seconds) if getattr(trainer, "save_seconds", None)
        else None,
        "checkpoints": sorted(n for n in _listdir(opts.output_dir) if n.startswith("checkpoint-")),
    }), flush=True)


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def _exit(code: int) -> None:
    """Leave without interpreter teardown: gloo threads still running can abort it (SIGABRT) after a
    finished run. Everything is closed and flushed by now."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    _exit(0)
