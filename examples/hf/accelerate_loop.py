"""A plain accelerate training loop whose ``save_state`` / ``load_state`` are flash checkpoints.

    accelerate launch --config_file examples/hf/two_processes.yaml examples/hf/accelerate_loop.py \
        --project-dir /tmp/gpt2-accelerate [--crash-at 12]

A tiny GPT-2 (random weights, 2 layers) learns the bytes of a bundled text. The Accelerator uses
``automatic_checkpoint_naming``; after ``flashckpt_integrations.adapters.accelerate.enable`` the
stock calls go through shared memory: ``accelerator.save_state()`` every ``--persist-every`` steps
(written to ``<project-dir>/checkpoints/checkpoint_<step>/`` by the background saver, in
accelerate's own format), and ``flash.save_state(step, persist=False)`` every ``--save-every``
steps (memory only). At start ``accelerator.load_state()`` restores the newest snapshot, from
memory after a crash. Each step's batch depends only on the step, so a resumed run ends with the
same parameters as an uninterrupted one.

The main process prints one JSON line: final step, where it resumed from, and a checksum of the
final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from flashckpt_integrations.adapters.accelerate import enable  # noqa: E402

TEXT = (
    "Checkpoints taken often and cheaply turn a crash from a lost afternoon into a lost minute. "
    "The copy into shared memory is quick; the write to storage happens elsewhere, in the background. "
)
SEQ_LEN, BATCH = 32, 4


def batch_for(step: int, rank: int) -> torch.Tensor:
    """Token windows of the bundled text, a pure function of (step, rank)."""
    data = torch.tensor(list((TEXT * 4).encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH,), generator=g)
    return torch.stack([data[s:s + SEQ_LEN] for s in starts.tolist()])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=3, help="memory-only snapshot every K steps")
    parser.add_argument("--persist-every", type=int, default=5, help="save_state() to storage every K steps")
    parser.add_argument("--total-limit", type=int, default=2, help="ProjectConfiguration(total_limit=...)")
    parser.add_argument("--crash-at", type=int, help="SIGKILL the main process right after step S is saved")
    parser.add_argument("--params-out", help="torch.save the final parameters here")
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), project_config=ProjectConfiguration(
        opts.project_dir, automatic_checkpoint_naming=True, total_limit=opts.total_limit))
    set_seed(42)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=SEQ_LEN,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    flash = enable(accelerator)
    accelerator.load_state()  # newest snapshot: memory after a crash, else storage; nothing on a first start
    start = flash.resumed_from[0] + 1 if flash.resumed_from else 1
    for step in range(start, opts.steps + 1):
        ids = batch_for(step, accelerator.process_index).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % opts.persist_every == 0:
            accelerator.save_state(os.path.join(opts.project_dir, "checkpoints", f"checkpoint_{step}"))
        elif step % opts.save_every == 0:
            flash.save_state(step, persist=False)
        if step == opts.crash_at:
            flash.wait()  # what is on disk at the crash does not depend on the machine's speed
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                print(json.dumps({"crashing_at": step}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    flash.close()
    if accelerator.is_main_process:
        params = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        if opts.params_out:
            torch.save(params, opts.params_out)
        digest = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()[:16]
        print(json.dumps({"final_step": opts.steps, "world_size": accelerator.num_processes,
                          "resumed_from": flash.resumed_from, "params_sha256": digest}), flush=True)
    accelerator.end_training()


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
