"""Train a tiny model with DeepSpeed and flash checkpoints; crash it; relaunch it; it resumes from memory.

    # 2 ranks on CPU, under the deepspeed launcher or torchrun:
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed/train.py --ckpt-dir /tmp/ds-ckpt --crash-at-step 7
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed/train.py --ckpt-dir /tmp/ds-ckpt
    # same with: torchrun --nproc-per-node 2 examples/deepspeed/train.py ...

Every step is snapshotted into shared memory (about one memory copy); every ``--persist-every``
steps the snapshot is also written by the background saver as DeepSpeed's own checkpoint
(``global_stepN/``, ``latest``). ``--crash-at-step N`` kills rank 0 with SIGKILL right after the
memory snapshot of step N; the relaunch finds every rank's snapshot of step N in shared memory
and resumes from it, although the newest checkpoint on disk is older. The last line printed is
a JSON summary; ``--out`` receives the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashckpt_integrations.adapters import deepspeed as flash_ds  # noqa: E402


def build_engine(zero_stage: int):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``step`` on ``rank``: the same in every run, however it was interrupted."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)


def final_parameters(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):
        return {name: p.detach().clone() for name, p in params}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--persist-every", type=int, default=5)
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--out", default=None, help="where rank 0 saves the final parameters")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engine = build_engine(args.zero_stage)
    flash = flash_ds.enable(engine, args.ckpt_dir, persist_interval=args.persist_every)

    engine.load_checkpoint(args.ckpt_dir)  # newest of: memory snapshot on every rank, committed checkpoint
    resumed = flash.last_load
    if rank == 0:
        print(f"[rank 0] starting at step {engine.global_steps}, resumed from {resumed}", flush=True)

    while engine.global_steps < args.steps:
        x, y = batch(engine.global_steps + 1, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        result = engine.save_checkpoint(args.ckpt_dir)  # memory every step; persisted every --persist-every
        if rank == 0:
            print(f"[rank 0] step {engine.global_steps} loss {loss.item():.5f} checkpoint {result.status.value} "
                  f"(held {result.blocking_s * 1000:.1f} ms)", flush=True)
        if engine.global_steps == args.crash_at_step and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    params = final_parameters(engine)
    flash.close()  # waits for the last persist, then frees the shared memory
    if rank == 0:
        if args.out:
            torch.save(params, args.out)
        summary = {"resumed_from": resumed, "final_step": engine.global_steps,
                   "committed_steps": flash.checkpointer.committed_steps()}
        print(json.dumps(summary), flush=True)
    dist.barrier()
    return 0


def _exit(code: int) -> None:
    """Leave without interpreter teardown: gloo threads still running can abort it (SIGABRT) after a
    finished run. Everything is closed and flushed by now."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
