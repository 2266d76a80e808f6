"""An accelerate training loop in the shape of accelerate's own checkpointing example, with flash checkpoints:
the four lines marked ``# flash`` are all it adds to the stock script.

    accelerate launch --config_file examples/hf/two_processes.yaml examples/hf/accelerate_checkpointing.py \
        --output_dir /tmp/accelerate-checkpointing --checkpointing_steps 3 [--crash_at 9]

The script keeps its own folders and its own resume: ``accelerator.save_state(<output_dir>/step_<N>)``
every ``--checkpointing_steps`` batches (or ``<output_dir>/epoch_<N>`` at the end of each epoch with
``--checkpointing_steps epoch``), and ``--resume_from_checkpoint <folder>`` resumes from that folder,
the step or epoch read from its name. With the flash lines, each ``save_state`` is a copy into shared
memory that is written to the folder in the background, and a relaunch without
``--resume_from_checkpoint`` resumes from the newest checkpoint, from memory after a crash (even one
whose folder was not written yet). ``--crash_at N`` kills the main process right after the checkpoint
of step (or epoch) N, to try it.

A small MLP with dropout learns a fixed synthetic regression; the main process prints one JSON line
with where it resumed and a checksum of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from flashckpt_integrations.adapters.accelerate import enable  # flash


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    return TensorDataset(x, x @ torch.randn(16, 4, generator=g))


def training_function(args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_dataloader = DataLoader(make_data(), batch_size=8)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    checkpointing_steps = None if args.checkpointing_steps == "epoch" else int(args.checkpointing_steps)

    starting_epoch, resume_step = 0, 0
    flash = enable(accelerator, args.output_dir)  # flash
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        if name.startswith("epoch_"):
            starting_epoch = int(name[len("epoch_"):]) + 1
        else:
            resume_step = int(name[len("step_"):])
            starting_epoch, resume_step = divmod(resume_step, len(train_dataloader))
    elif accelerator.load_state():  # flash: the newest checkpoint, from memory after a crash
        starting_epoch, resume_step = flash.resume_point(len(train_dataloader))  # flash

    overall_step = starting_epoch * len(train_dataloader) + resume_step
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        batches = train_dataloader
        if epoch == starting_epoch and resume_step:
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if checkpointing_steps and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
                crash_if(args, accelerator, overall_step)
        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
            crash_if(args, accelerator, epoch)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        params = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        digest = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()[:16]
        print(json.dumps({"resumed_from": args.resume_from_checkpoint or None, "final_step": overall_step,
                          "params_sha256": digest}), flush=True)
    accelerator.end_training()


def crash_if(args: argparse.Namespace, accelerator: Accelerator, when: int) -> None:
    if when == args.crash_at:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            print(json.dumps({"crashing_at": when}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--checkpointing_steps", default="epoch", help="a number of batches, or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--crash_at", type=int, help="SIGKILL the main process after the checkpoint of step N")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # gloo threads can abort the interpreter's teardown
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
