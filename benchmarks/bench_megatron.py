#!/usr/bin/env python3
"""Megatron-LM's save_checkpoint: the flash patch against Megatron's own synchronous and async saves.

    .venv-megatron/bin/python benchmarks/bench_megatron.py                 # GPT ~60M params, TP=2, 5 repeats
    .venv-megatron/bin/python benchmarks/bench_megatron.py --layout dp2 --hidden 768 --repeats 7

Needs the Megatron environment (``bash scripts/test-megatron.sh`` makes ``.venv-megatron``:
Python 3.12, megatron-core 0.19.2). Starts itself under torchrun (2 ranks, gloo, CPU; the CPU
shims of ``tests/megatron`` are applied when there is no GPU). One model, one run; every repeat
saves the same trained state once per configuration, round-robin, each into its own directory:

* ``megatron_sync``: stock ``save_checkpoint`` with ``--ckpt-format torch`` (blocking = on disk)
* ``megatron_async`` / ``_done``: stock ``save_checkpoint`` with ``--ckpt-format torch_dist
  --async-save`` (the call), and until ``maybe_finalize_async_save(blocking=True)`` returns
* ``flash`` / ``_committed``: the patched ``save_checkpoint`` (``--ckpt-format torch``): the call,
  and until the commit (every rank's files durable, tracker written)

A metric's time is the slowest rank's; the table gives medians and ratios to ``megatron_sync``.
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
    import torch
    import worker as tiny  # the tests' GPT helpers (model provider, build, train; applies the CPU shims)
    from megatron.training import checkpointing, get_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.initialize import initialize_megatron

    from flashckpt_integrations.adapters import megatron as flash_megatron

    dist = torch.distributed
    root = tempfile.mkdtemp(prefix="bench-megatron-", dir=opts.dir) if os.environ.get("RANK") == "0" else ""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = [sys.argv[0], *tiny.megatron_argv(opts.layout, os.path.join(root or "/unused", "x"),
                                                  layers=opts.layers, hidden=opts.hidden, vocab=opts.vocab),
                "--async-strategy", "mcore"]
    parse_and_validate_args()
    with tiny.cpu_shims.fake_cuda_device_count():
        initialize_megatron(allow_no_cuda=True)
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    args = get_args()
    model, optimizer, scheduler = tiny.build(seed=7)
    tiny.train(model, optimizer, scheduler, 1, 1)  # the optimizer's state exists
    params = sum(p.numel() for m in model for p in m.parameters())
    flash = flash_megatron.patch(persist_interval=1)
    stock_save = flash._originals["save_checkpoint"]

    def save(kind: str, iteration: int) -> dict[str, float]:
        args.save = os.path.join(root, kind)
        args.ckpt_format = "torch_dist" if kind == "megatron_async" else "torch"
        args.use_dist_ckpt = args.ckpt_format != "torch"
        args.async_save = kind == "megatron_async"
        dist.barrier()
        started = time.perf_counter()
        if kind == "flash":
            checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)
            blocking = time.perf_counter() - started
            outcome = flash.wait()
            if not outcome.committed:
                raise RuntimeError(f"flash iteration {iteration} was not committed: {outcome.error}")
            return {"flash": blocking, "flash_committed": time.perf_counter() - started}
        stock_save(iteration, model, optimizer, scheduler, 0)
        blocking = time.perf_counter() - started
        if kind == "megatron_async":
            maybe_finalize_async_save(blocking=True)
            return {kind: blocking, f"{kind}_done": time.perf_counter() - started}
        return {kind: blocking}

    samples: dict[str, list[float]] = {}
    try:
        for repeat in range(opts.repeats + 1):
            for kind in ("megatron_sync", "megatron_async", "flash"):
                local = save(kind, 10 + repeat)
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, local)
                if repeat > 0:
                    for key in local:
                        samples.setdefault(key, []).append(max(g[key] for g in gathered))
    finally:
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
    lines = [f"GPT {opts.layers} layers, hidden {opts.hidden}, vocab {opts.vocab}, {opts.layout} on 2 ranks: "
             f"{sum(params) / 1e6:.1f}M parameters held by the ranks (weights + 2 Adam moments in fp32 saved); "
             f"{opts.repeats} repeats; files under {opts.dir}", "",
             "| metric | median s | min s | x megatron_sync |", "|---|---|---|---|"]
    for key in ("megatron_sync", "megatron_async", "megatron_async_done", "flash", "flash_committed"):
        lines.append(f"| {key} | {med[key]:.3f} | {min(samples[key]):.3f} | {med[key] / base:.2f} |")
    lines += ["", f"flash blocking: {med['flash'] / base:.2f}x Megatron's synchronous save, "
              f"{med['flash'] / med['megatron_async']:.2f}x its async save's blocking part"]
    return "\n".join(lines)


def main() -> int:
    opts = parse()
    if not os.environ.get("FLASHCKPT_BENCH_WORKER"):
        return launch()
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
