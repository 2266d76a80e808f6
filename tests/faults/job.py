"""The job of the fault-injection tests: one rank of a tiny deterministic data-parallel run.

Launched by ``harness.launch`` (two processes, gloo, the torchrun environment variables). Each
step's batch is a function of (seed, step, rank) only and gradients are averaged with one
``all_reduce`` per parameter, so :func:`reference` recomputes every rank's state at every step
in one process, bit for bit. Every step is snapshotted to memory and every ``persist_every``-th
step is persisted, with retention keeping the newest two commits.

``--fault SPEC`` arms ``FLASHCKPT_FAULT`` in this process (and in a saver it starts) for the
first saver only: once this rank is connected to the node's saver the knob is dropped from the
environment, so a saver restarted after an injected kill runs without it.

Each rank writes ``<out>/rank-<r>.json``: where it resumed from, how long that took, and every
persisting save's outcome; rank 0 also writes ``<out>/final.pt`` (the model's final state).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8
KEEP_LAST = 2


@dataclass(frozen=True)
class JobConfig:
    steps: int = 12
    persist_every: int = 3
    seed: int = 0
    world_size: int = 2

    @property
    def regions(self) -> int:
        """Tensor storages in one rank's state: 6 parameters, and AdamW's step, exp_avg, exp_avg_sq each."""
        return 6 * 4

    @property
    def persists(self) -> int:
        return self.steps // self.persist_every

    def hits(self, point: str) -> int:
        """How often an uninterrupted run reaches ``point`` (in the one process that can be killed)."""
        return {
            "trainer.copy": self.regions * self.steps,
            "trainer.sealed": self.steps,
            "saver.write": self.regions * self.world_size * self.persists,
            "saver.commit": self.persists,
            "retention.delete": max(0, self.persists - KEEP_LAST),
        }[point]


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                          nn.Linear(HIDDEN, OUT))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def local_grads(model: nn.Module, seed: int, step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (BATCH,), generator=g)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step, "rank": rank}


def reference(cfg: JobConfig) -> dict[int, dict]:
    """Every step's state (cloned) of an uninterrupted run, rank-independent part; computed in one process."""
    import copy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optimizer = build(cfg.seed)
        states = {}
        for step in range(1, cfg.steps + 1):
            summed = [g.clone() for g in local_grads(model, cfg.seed, step, 0)]
            for rank in range(1, cfg.world_size):
                for total, grad in zip(summed, local_grads(model, cfg.seed, step, rank)):
                    total.add_(grad)
            for p, total in zip(model.parameters(), summed):
                p.grad = total.div_(cfg.world_size)
            optimizer.step()
            states[step] = copy.deepcopy(state(model, optimizer, step, 0))
        return states
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=JobConfig.steps)
    parser.add_argument("--persist-every", type=int, default=JobConfig.persist_every)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", default="")
    parser.add_argument("--commit-timeout", type=float, default=20.0)
    args = parser.parse_args()
    if args.fault:
        os.environ["FLASHCKPT_FAULT"] = args.fault  # before the package (and its fault module) is imported
    torch.set_num_threads(1)
    import torch.distributed as dist

    from flashckpt_integrations import Checkpointer, RetentionPolicy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(args.seed)
    ck = Checkpointer(args.ckpt, optimizers=[optimizer], retention=RetentionPolicy(keep_last=KEEP_LAST),
                      commit_timeout_s=args.commit_timeout)
    if args.fault:  # once the node's saver is started (with the knob) or found, drop it
        while not (os.path.exists(os.path.join(ck.run_dir, "saver.log")) or ck.client.connected):
            time.sleep(0.005)
        os.environ.pop("FLASHCKPT_FAULT")
    started = time.monotonic()
    loaded = ck.load()
    record = {"rank": rank, "resumed": None, "source": None, "load_s": time.monotonic() - started,
              "resumed_at": time.time(), "saves": [], "persisted": []}
    first = 1
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optim"])
        record.update(resumed=loaded.step, source=loaded.source)
        first = loaded.step + 1
    persisting = []
    for step in range(first, args.steps + 1):
        grads = local_grads(model, args.seed, step, rank)
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(world)
        optimizer.step()
        persist = step % args.persist_every == 0
        if persist and persisting:  # the previous persist's outcome, before retention may delete that step
            outcome = persisting[-1].wait()
            record["persisted"].append({"step": outcome.step, "committed": outcome.committed, "error": outcome.error})
        result = ck.save(step, state(model, optimizer, step, rank), persist=persist)
        record["saves"].append({"step": step, "status": result.status.value, "reason": result.reason})
        if result.status.value == "persisting":
            persisting.append(result)
    final = ck.wait()
    record["final"] = final and {"step": final.step, "committed": final.committed, "error": final.error}
    if final is not None:
        record["persisted"].append({"step": final.step, "committed": final.committed, "error": final.error})
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    ck.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def entry(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """:func:`main` in a process forked from a server that has imported torch already."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [__file__, *argv]
    faults = sys.modules.get("flashckpt_integrations._utils.faults")
    if faults is not None:  # the server had imported the package: arm this rank's fault all the same
        faults._PLAN = faults.parse(argv[argv.index("--fault") + 1] if "--fault" in argv else "")
    main()


if __name__ == "__main__":
    main()
