"""A data-parallel training job for the replica tests, run under torchrun.

Every rank trains the same tiny model on batches of its own; the gradients are averaged in rank
order (all_gather, then summed rank 0 first), so every rank holds the same parameters and a run is
reproducible bit for bit: :func:`reference` computes it in one process. It resumes with ``load()``,
snapshots into memory every ``--snapshot-every`` steps (default 1) and persists every
``--persist-every`` steps. With ``--api dcp``
it saves and resumes through the DCP adapter (``flash_dcp.save`` / ``flash_dcp.load``) instead. With ``--pause-at``
it stops after that step's save, touches ``<out>/paused-<rank>`` and waits to be killed (with
``--last-save-on-sigterm``, for SIGTERM: the next step is then saved persisting and ends the run). Each rank
writes ``<out>/rank-<rank>.json`` (its load, its saves) and, at the end, ``<out>/final-<rank>.pt``.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from flashckpt_integrations import Checkpointer, StopSignal
from flashckpt_integrations.adapters import dcp as flash_dcp


def make_model(width: int = 32, ballast_mib: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer; with ``ballast_mib``, a buffer of that size in the model's state
    (a large state without large matrix products, whose results may depend on where the tensors lie)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16))
    if ballast_mib:
        model.register_buffer("ballast", torch.zeros(ballast_mib * 2**20 // 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def advance_ballast(model: torch.nn.Module, step: int) -> None:
    """Every element of the ballast changes at every step, element by element (exact anywhere)."""
    if hasattr(model, "ballast"):
        model.ballast.mul_(0.5).add_(float(step))


def rank_gradients(model: torch.nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def apply_mean(model: torch.nn.Module, opt: torch.optim.Optimizer, per_rank: list[list[torch.Tensor]]) -> None:
    for i, p in enumerate(model.parameters()):
        total = per_rank[0][i].clone()
        for grads in per_rank[1:]:
            total += grads[i]
        p.grad = total / len(per_rank)
    opt.step()


def reference(steps: int, world: int, width: int = 32, ballast_mib: int = 0) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` uninterrupted steps of a ``world``-rank job."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt = make_model(width, ballast_mib)
        for step in range(1, steps + 1):
            apply_mean(model, opt, [rank_gradients(model, step, r) for r in range(world)])
            advance_ballast(model, step)
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--persist-every", type=int, default=5)
    parser.add_argument("--snapshot-every", type=int, default=1, help="a memory snapshot every N steps")
    parser.add_argument("--pause-at", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--api", choices=("core", "dcp"), default="core")
    parser.add_argument("--width", type=int, default=32, help="the hidden layer's width")
    parser.add_argument("--ballast-mib", type=int, default=0, help="a buffer of this size in the model's state")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step takes beyond its compute")
    parser.add_argument("--storage-factory", default=None, help="e.g. tests.helpers:SlowStorage")
    parser.add_argument("--dump-loaded", action="store_true", help="write the restored state to <out>/loaded-<rank>.pt")
    parser.add_argument("--print-steps", action="store_true", help="rank 0 prints a JSON line after each save")
    parser.add_argument("--last-save-on-sigterm", action="store_true",
                        help="StopSignal: SIGTERM ends a pause; the next step is saved persisting, and the last")
    args = parser.parse_args()
    stop = StopSignal() if args.last_save_on_sigterm else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_model(args.width, args.ballast_mib)
    dcp = args.api == "dcp"
    ck = Checkpointer(args.ckpt, flash_dcp.checkpointer_config() if dcp else None, replicas=args.replicas,
                      storage_factory=args.storage_factory)
    progress = {"step": torch.zeros((), dtype=torch.int64)}
    record = {"rank": rank, "pid": os.getpid(), "run_dir": ck.run_dir, "saves": []}
    path = os.path.join(args.out, f"rank-{rank}.json")

    def flush() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    started = time.perf_counter()
    loaded = flash_dcp.load(ck, {"model": model, "optim": opt, "progress": progress}) if dcp else ck.load()
    start = 0
    if dcp:
        start = int(progress["step"])
    elif loaded is not None:
        model.load_state_dict(loaded.state["model"])
        opt.load_state_dict(loaded.state["optim"])
        start = loaded.state["step"]
    record["load"] = {"step": loaded and loaded.step, "source": loaded and loaded.source,
                      "fetched": ck.replicas.fetched, "seconds": time.perf_counter() - started,
                      "tiers": None if dcp or loaded is None else {str(r): t for r, t in loaded.tiers.items()}}
    flush()
    if args.dump_loaded:
        torch.save(model.state_dict(), os.path.join(args.out, f"loaded-{rank}.pt"))
    for step in range(start + 1, args.steps + 1):
        stopping = stop is not None and stop.agreed()
        grads = rank_gradients(model, step, rank)
        time.sleep(args.step_sleep)
        gathered = [[torch.empty_like(g) for g in grads] for _ in range(world)]
        for i, g in enumerate(grads):
            dist.all_gather([gathered[r][i] for r in range(world)], g)
        apply_mean(model, opt, gathered)
        advance_ballast(model, step)
        persist = step % args.persist_every == 0 or stopping
        if not persist and step % args.snapshot_every:
            if args.print_steps and rank == 0:
                print(json.dumps({"at": step, "snapshot": None}), flush=True)
            continue
        if dcp:
            progress["step"].fill_(step)
            result = flash_dcp.save(ck, step, {"model": model, "optim": opt, "progress": progress}, persist=persist)
        else:
            result = ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                             persist=persist)
        record["saves"].append({"step": step, "status": result.status.value, "blocking_s": result.blocking_s})
        if args.print_steps and rank == 0:
            print(json.dumps({"at": step, "snapshot": step if result.ok else None}), flush=True)
        if step == args.pause_at:
            flush()
            open(os.path.join(args.out, f"paused-{rank}"), "w").close()
            while not (stop is not None and stop.requested):
                time.sleep(0.05)
        if stopping:  # the job is being stopped: this step was the last save
            record["stopped_at"] = step
            break
    outcome = ck.wait()
    record["committed"] = outcome is not None and outcome.committed
    torch.save(model.state_dict(), os.path.join(args.out, f"final-{rank}.pt"))
    ck.close()
    flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
