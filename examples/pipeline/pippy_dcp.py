"""Pipeline-parallel training with flash DCP checkpoints: every stage saves its part at once.

    torchrun --nproc-per-node 2 examples/pipeline/pippy_dcp.py --ckpt /tmp/pp --steps 8 --crash-at 7
    torchrun --nproc-per-node 2 examples/pipeline/pippy_dcp.py --ckpt /tmp/pp --steps 8   # resumes from memory
    python examples/pipeline/pippy_dcp.py --ckpt /tmp/pp --load-only --dump /tmp/pp1     # the same checkpoint, 1 stage

Each rank is one stage of ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``);
the stage module is the model with the other stages' layers removed, so its parameters keep the
original model's names (``layers.3.weight``, never ``stage1.…``). One collective
``flash_dcp.save`` per checkpoint: each rank's stage goes into its shared-memory slot at the same
time, and the saver writes one DCP checkpoint (``step-<N>/``) whose keys are the unsplit model's.
The optimizer state is keyed by parameter name, so the checkpoint loads into any number of stages.

Every ``--memory-every`` steps a memory-only snapshot is taken, every ``--persist-every`` steps one
is persisted; ``--crash-at`` SIGKILLs every rank after that step's snapshot (once the persisted
steps are committed); the next launch resumes from shared memory, which holds a newer step than
storage. ``--dump DIR`` writes each rank's
stage state (model and optimizer, by name) to ``DIR/stage-<rank>.pt`` at the end; ``--load-only``
loads the newest checkpoint from storage, dumps and exits.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from flashckpt_integrations import Checkpointer
from flashckpt_integrations.adapters import dcp as flash_dcp

WIDTH, LAYERS, MICROBATCHES = 32, 4, 2


class Model(nn.Module):
    """A stack of layers; a stage keeps a contiguous subset and the original names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


def stage_module(stage: int, stages: int) -> nn.Module:
    """The model with the layers of other stages removed (``torchtitan``'s manual split)."""
    module = copy.deepcopy(Model())
    per_stage = LAYERS // stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for name in list(module.layers):
        if name not in keep:
            del module.layers[name]
    if stage != 0:
        module.embed = None
    if stage != stages - 1:
        module.head = None
    return module


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4 * MICROBATCHES, 8, generator=g)
    return x, x.sum(-1, keepdim=True).cos()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class Trainer:
    def __init__(self, rank: int, stages: int) -> None:
        self.rank, self.stages = rank, stages
        self.module = stage_module(rank, stages)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.state = {"model": flash_dcp.ModelState(self.module),
                      "optimizer": flash_dcp.OptimizerState(self.module, self.optimizer)}
        if stages > 1:
            stage = PipelineStage(self.module, rank, stages, torch.device("cpu"))
            self.schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)

    def step(self, step: int) -> None:
        x, y = batch(step)
        if self.stages == 1:  # the same micro-batching as the schedule
            for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                (loss_fn(self.module(xs), ys) / MICROBATCHES).backward()
        elif self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.stages - 1:
            self.schedule.step(target=y)
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def dump(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        state = {name: value.state_dict() for name, value in self.state.items()}
        torch.save(state, os.path.join(directory, f"stage-{self.rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--memory-every", type=int, default=1)
    parser.add_argument("--persist-every", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--dump", default=None)
    parser.add_argument("--load-only", action="store_true")
    args = parser.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if LAYERS % world:
        raise SystemExit(f"{LAYERS} layers do not split into {world} stages")
    trainer = Trainer(rank, world)
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config())
    loaded = flash_dcp.load(ck, trainer.state, prefer_memory=not args.load_only)
    start = loaded.step if loaded else 0
    report = {"rank": rank, "stages": world, "resumed": loaded and [loaded.step, loaded.source], "saves": []}
    for step in range(start + 1, 0 if args.load_only else args.steps + 1):
        trainer.step(step)
        persist = step % args.persist_every == 0
        if persist or step % args.memory_every == 0:
            result = flash_dcp.save(ck, step, trainer.state, persist=persist)
            report["saves"].append([step, result.status.value, round(result.blocking_s, 4)])
        if step == args.crash_at:
            ck.wait()  # the persisted steps are committed; the newest snapshot is in memory only
            if dist.is_initialized():
                dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    outcome = ck.wait()
    report["committed"] = outcome and [outcome.step, outcome.committed]
    if args.dump:
        trainer.dump(args.dump)
        with open(os.path.join(args.dump, f"report-{rank}.json"), "w") as f:
            json.dump(report, f)
    ck.close()
    print(json.dumps(report), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
