"""Train the tiny GPT-2 in its own process, for the crash tests (run by tests/hf/test_hf_trainer.py).

    python tests/hf/train_script.py --out DIR --result FILE [--plain] [--kill-at S] [--resume]
    python -m torch.distributed.run --nproc-per-node 2 tests/hf/train_script.py ...   (DDP, gloo)

With ``--kill-at S`` the process (rank 0 under torchrun) SIGKILLs itself right after the memory-only
snapshot of step S (at the beginning of step S+1). At the end it writes the final parameters to ``FILE`` (torch.save)
and prints one JSON line with what the trainer did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.helpers import exit_without_teardown  # noqa: E402
from tests.hf.common import make_trainer, parameters  # noqa: E402


class KillAfterSnapshot(TrainerCallback):
    def __init__(self, trainer: FlashCkptTrainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            last = self.trainer.flash_last_save
            assert last is not None and last.step == self.step and last.status.value == "in_memory", last
            self.trainer.flash_checkpointer.wait_for_snapshot()  # an overlapped copy (async_snapshot) is done
            if dist.is_initialized():
                dist.barrier()  # every rank holds the snapshot; then rank 0 dies and torchrun ends the others
            if args.process_index == 0:
                print(json.dumps({"killing_at": self.step}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--memory-interval", type=int, default=3)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--plain", action="store_true", help="the stock transformers.Trainer")
    opts = parser.parse_args()
    if opts.plain:
        trainer = make_trainer(Trainer, opts.out, max_steps=opts.max_steps, save_steps=opts.save_steps)
    else:
        trainer = make_trainer(FlashCkptTrainer, opts.out, max_steps=opts.max_steps, save_steps=opts.save_steps,
                               flash_memory_interval=opts.memory_interval)
    if opts.kill_at is not None:
        trainer.add_callback(KillAfterSnapshot(trainer, opts.kill_at))
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    if trainer.args.process_index != 0:
        return
    torch.save(parameters(trainer.model), opts.result)
    print(json.dumps({
        "final_step": trainer.state.global_step,
        "resumed_from": getattr(trainer, "flash_resumed_from", None),
    }), flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
