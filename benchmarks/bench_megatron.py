#!/usr/bin/env python3
"""Megatron-LM's save_checkpoint: the flash patch against Megatron's own synchronous and async saves.

    .venv-megatron/bin/python benchmarks/bench_megatron.py                 # GPT ~34M params, TP=2, 5 repeats
    .venv-megatron/bin/python benchmarks/bench_megatron.py --layout dp2 --hidden 768 --repeats 7
    .venv-megatron/bin/python benchmarks/bench_megatron.py --format torch  # Megatron's legacy format

Needs the Megatron environment (``bash scripts/test-megatron.sh`` makes ``.venv-megatron``:
Python 3.12, megatron-core 0.19.2). Starts itself under torchrun (2 ranks, gloo, CPU; the CPU
shims of ``tests/megatron`` are applied when there is no GPU). One model, one run, one checkpoint
format (``--format``, default Megatron's ``torch_dist``); every repeat saves the same trained state
once per configuration, round-robin, each into its own directory:

* ``megatron_sync``: stock ``save_checkpoint`` (blocking = on disk, tracker written)
* ``megatron_async`` / ``_done``: stock ``save_checkpoint`` with ``--async-save
  --use-persistent-ckpt-worker`` (``torch_dist`` only: Megatron has no async legacy save): the
  call, and until ``maybe_finalize_async_save(blocking=True)`` returns (files, ``metadata.json``
  and the tracker written)
* ``flash`` / ``_committed``: the patched ``save_checkpoint`` without ``--async-save``: the call,
  and until the commit (every rank's files durable, tracker written)
* ``flash_overlap`` / ``_copied`` / ``_committed``: the patched ``save_checkpoint`` with the same
  flags as ``megatron_async`` (under the patch ``--async-save`` overlaps the copy into shared
  memory with the next iteration; its optimizer step waits for it): the call, until the copy is
  done (what a step that follows at once would wait), and until the commit

A metric's time is the slowest rank's; the table gives medians over repeats and the medians of
the per-repeat ratios to Megatron's async save: blocking (target <= 0.5) and committed (target
<= 1.0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp2", choices=("tp2", "pp2", "dp2"))
    parser.add_argument("--format", default="torch_dist", choices=("torch_dist", "torch"),
                        help="--ckpt-format of megatron_sync and flash (megatron_async is always torch_dist)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5, help="measured repeats (plus one warm-up)")
    parser.add_argument("--dir", default="/tmp", help="where checkpoints are written (a local disk)")
    return parser.parse_args()


def launch() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHCKPT_BENCH_WORKER": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def run(opts: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(REPO, "tests", "megatron"))
    import tiny_gpt as tiny  # the tests' GPT helpers (model provider, build, train; applies the CPU shims)
    import torch
    from megatron.training import checkpointing, get_args
    from megatron.training.async_utils import init_persistent_async_worker, maybe_finalize_async_save

    from flashckpt_integrations.adapters import megatron as flash_megatron

    dist = torch.distributed
    root = tempfile.mkdtemp(prefix="bench-megatron-", dir=opts.dir) if os.environ.get("RANK") == "0" else ""
    tiny.start([*tiny.megatron_argv(opts.layout, os.path.join(root or "/unused", "x"), layers=opts.layers,
                                    hidden=opts.hidden, vocab=opts.vocab, ckpt_format=opts.format),
                "--async-strategy", "mcore"])
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    args = get_args()
    # Megatron's persistent checkpoint worker, as initialize_megatron() starts it for --async-save
    # --use-persistent-ckpt-worker (fork: the worker inherits the CPU shims)
    init_persistent_async_worker(args.rank, "fork" if not torch.cuda.is_available() else "forkserver")
    model, optimizer, scheduler = tiny.build(seed=7)
    tiny.train(model, optimizer, scheduler, 1, 1)  # the optimizer's state exists
    params = sum(p.numel() for m in model for p in m.parameters())
    flash = flash_megatron.patch(persist_interval=1)
    stock_save = flash._originals["save_checkpoint"]
    kinds = ["megatron_sync", "megatron_async", "flash", "flash_overlap"]

    def save(kind: str, iteration: int) -> dict[str, float]:
        args.save = os.path.join(root, kind)
        args.ckpt_format = "torch_dist" if kind == "megatron_async" else opts.format
        args.use_dist_ckpt = args.ckpt_format != "torch"
        args.async_save = args.use_persistent_ckpt_worker = kind in ("megatron_async", "flash_overlap")
        dist.barrier()
        started = time.perf_counter()
        if kind.startswith("flash"):
            checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)
            times = {kind: time.perf_counter() - started}
            if kind == "flash_overlap":
                flash.checkpointer(args.save).wait_for_snapshot()
                times[f"{kind}_copied"] = time.perf_counter() - started
            outcome = flash.wait()
            if not outcome.committed:
                raise RuntimeError(f"flash iteration {iteration} was not committed: {outcome.error}")
            return {**times, f"{kind}_committed": time.perf_counter() - started}
        stock_save(iteration, model, optimizer, scheduler, 0)
        blocking = time.perf_counter() - started
        if kind == "megatron_async":
            maybe_finalize_async_save(blocking=True)
            return {kind: blocking, f"{kind}_done": time.perf_counter() - started}
        return {kind: blocking}

    samples: dict[str, list[float]] = {}
    try:
        for repeat in range(opts.repeats + 1):
            order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]  # none always runs first
            for kind in order:
                local = save(kind, 10 + repeat)
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, local)
                if repeat > 0:
                    for key in local:
                        samples.setdefault(key, []).append(max(g[key] for g in gathered))
    finally:
        args.async_save = True
        maybe_finalize_async_save(blocking=True, terminate=True)
        flash_megatron.unpatch()
    gathered_params = [None] * dist.get_world_size()
    dist.all_gather_object(gathered_params, params)
    if dist.get_rank() == 0:
        print(table(samples, opts, gathered_params), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


def table(samples: dict[str, list[float]], opts: argparse.Namespace, params: list[int]) -> str:
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["megatron_sync"]
    lines = [f"GPT {opts.layers} layers, hidden {opts.hidden}, vocab {opts.vocab}, {opts.layout} on 2 ranks, "
             f"--ckpt-format {opts.format}: {sum(params) / 1e6:.1f}M parameters held by the ranks (weights + 2 Adam "
             f"moments in fp32 saved); {opts.repeats} repeats; files under {opts.dir}", "",
             "| metric | median s | min s | x megatron_sync |", "|---|---|---|---|"]
    for key in ("megatron_sync", "megatron_async", "megatron_async_done", "flash", "flash_committed",
                "flash_overlap", "flash_overlap_copied", "flash_overlap_committed"):
        lines.append(f"| {key} | {med[key]:.3f} | {min(samples[key]):.3f} | {med[key] / base:.2f} |")
    lines.append("")
    for kind in ("flash", "flash_overlap"):
        blocking = _ratio(samples[kind], samples["megatron_async"])
        committed = _ratio(samples[f"{kind}_committed"], samples["megatron_async_done"])
        lines.append(f"{kind}: blocking {blocking:.2f}x Megatron's async save's blocking part (target <= 0.5); "
                     f"committed {committed:.2f}x the time until Megatron's async save is finalized (target <= 1.0)")
    return "\n".join(lines)


def _ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the per-repeat ratios (this machine drifts between repeats)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def main() -> int:
    opts = parse()
    if not os.environ.get("FLASHCKPT_BENCH_WORKER"):
        return launch()
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
