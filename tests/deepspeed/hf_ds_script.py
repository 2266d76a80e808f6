"""Train the tiny GPT-2 with the HF Trainer's DeepSpeed path (ZeRO-2, CPU), under torchrun with 2 ranks.

    torchrun --nproc-per-node 2 tests/deepspeed/hf_ds_script.py --out DIR --result FILE [--plain]
        [--kill-at S] [--resume | --resume-from PATH]

``--plain``: the stock ``transformers.Trainer``; otherwise ``FlashCkptTrainer`` with a memory-only
snapshot every ``--memory-interval`` steps. ``--kill-at S``: rank 0 SIGKILLs itself right after the
memory-only snapshot of step S. Prints one JSON line (rank 0) and saves the final parameters to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402, F401  (before transformers: DeepSpeed's accelerator on CPU)
import torch.distributed as dist  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.hf.common import make_trainer, parameters  # noqa: E402

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


class KillAfterSnapshot(TrainerCallback):
    def __init__(self, trainer: FlashCkptTrainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        last = self.trainer.flash_last_save
        if last is None:  # FlashCkptTrainer used the stock DeepSpeed checkpointing
            if args.process_index == 0:
                print(json.dumps({"flash": False}), flush=True)
            dist.barrier()
            os._exit(0)
        assert last.step == self.step and last.status.value == "in_memory", last
        dist.barrier()  # every rank holds the snapshot; then rank 0 dies and torchrun ends the others
        if args.process_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--memory-interval", type=int, default=2)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--plain", action="store_true", help="the stock transformers.Trainer")
    opts = parser.parse_args()
    args = {"deepspeed": DS_CONFIG}
    if opts.plain:
        trainer = make_trainer(Trainer, opts.out, max_steps=opts.max_steps, save_steps=opts.save_steps, args=args)
    else:
        trainer = make_trainer(FlashCkptTrainer, opts.out, max_steps=opts.max_steps, save_steps=opts.save_steps,
                               args=args, flash_memory_interval=opts.memory_interval)
    if opts.kill_at is not None:
        trainer.add_callback(KillAfterSnapshot(trainer, opts.kill_at))
    trainer.train(resume_from_checkpoint=opts.resume_from or (True if opts.resume else None))
    if trainer.args.process_index == 0:
        import torch

        torch.save(parameters(trainer.model), opts.result)
        last = getattr(trainer, "flash_last_save", None)
        print(json.dumps({"flash": not opts.plain, "resumed_from": getattr(trainer, "flash_resumed_from", None),
                          "global_step": trainer.state.global_step,
                          "last_save": None if last is None else [last.step, last.status.value]}), flush=True)
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)  # avoids a rare SIGABRT at interpreter exit after DDP training (see frameworks-on-cpu.md)


if __name__ == "__main__":
    main()
