#!/usr/bin/env python3
"""Training throughput of FlashCkptTrainer against the stock Trainer and against no checkpointing.

A GPT-2 built from a config (random weights, about 100M parameters by default) trains on the
CPU for ``--steps`` optimizer steps; the checkpointing runs save a checkpoint every ``--every``
steps. Four configurations, each in a fresh process, round-robin over ``--repeats`` rounds (each
round starts at a different configuration, so none always runs after the same one):

* ``no_checkpoint``: ``save_strategy="no"``
* ``trainer``: the stock ``transformers.Trainer`` saving ``checkpoint-N`` at the same steps
* ``flash``: ``FlashCkptTrainer`` at the same steps (snapshot into shared memory, the saver writes
  ``checkpoint-N`` in the background)
* ``flash_overlap``: the same with ``flash_config={"async_snapshot": True}``: the copy into shared
  memory runs beside the next forward and backward pass (the optimizer step waits for it)

For each: the wall time of ``trainer.train()`` (including the wait for the last checkpoint to be
committed, also shown apart as "end wait"), the training throughput over the whole of ``train()``
(steps/s) and its ratio to ``no_checkpoint``, and the time each checkpoint held training (median).
The Trainer also saves at the last step, so every checkpointing run ends with one save.

The ratio is taken within each round (a configuration's steps/s over the ``no_checkpoint`` run of
the same round), and the median over rounds is reported: the speed of a shared machine drifts by
more than the effect measured here between runs minutes apart, and within a round it drifts least.

Training uses ``--threads`` torch threads (default 1), which leaves this machine's other core to
the saver, as a GPU host leaves its CPU cores to it; ``--threads 0`` uses torch's default.

    python benchmarks/bench_hf.py                       # ~100M parameters, 3 rounds
    python benchmarks/bench_hf.py --layers 2 --hidden 256 --steps 25 --every 10 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIGS = ("no_checkpoint", "trainer", "flash", "flash_overlap")
TARGET = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--every", type=int, default=30, help="checkpoint every K steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the training process (0: torch's default, one per core)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- one training run (in its own process) ------------------------------------------------------


def run_worker(opts: argparse.Namespace) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

    from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, opts.vocab, (n, opts.seq), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=opts.layers, n_embd=opts.hidden, n_head=max(1, opts.hidden // 64),
                                       vocab_size=opts.vocab, n_positions=opts.seq, bos_token_id=0, eos_token_id=0))
    saving = opts.worker != "no_checkpoint"
    args = TrainingArguments(
        opts.out, max_steps=opts.steps, per_device_train_batch_size=opts.batch, learning_rate=1e-4,
        save_strategy="steps" if saving else "no", save_steps=opts.every, logging_strategy="no", seed=0,
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    base = FlashCkptTrainer if opts.worker.startswith("flash") else Trainer
    extra = {"flash_config": {"async_snapshot": True}} if opts.worker == "flash_overlap" else {}
    stalls: list[float] = []

    if base is FlashCkptTrainer:  # the whole snapshot: the save chain and the copy into shared memory
        class Timed(base):
            def _flash_snapshot(self, model, persist):
                started = time.perf_counter()
                result = super()._flash_snapshot(model, persist)
                if persist:
                    stalls.append(time.perf_counter() - started)
                return result
    else:
        class Timed(base):
            def _save_checkpoint(self, model, trial):
                started = time.perf_counter()
                super()._save_checkpoint(model, trial)
                stalls.append(time.perf_counter() - started)

    marks: dict[str, float] = {}
    step_ends: list[float] = []

    class LoopEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            marks["loop_end"] = time.perf_counter()

    trainer = Timed(model=model, args=args, train_dataset=Tokens(opts.steps * opts.batch), callbacks=[LoopEnd()],
                    **extra)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    loop = marks["loop_end"] - started
    checkpoints = sorted(n for n in os.listdir(opts.out) if n.startswith("checkpoint-"))
    return {"config": opts.worker, "wall_s": wall, "loop_s": loop, "final_wait_s": wall - loop,
            "steps_per_s": opts.steps / wall, "loop_steps_per_s": opts.steps / loop, "stalls_s": stalls,
            "step_s": [round(b - a, 3) for a, b in zip(step_ends, step_ends[1:])],
            "checkpoints": checkpoints, "params": sum(p.numel() for p in model.parameters())}


# --- the driver ---------------------------------------------------------------------------------


def run_one(config: str, opts: argparse.Namespace, root: str) -> dict:
    out = os.path.join(root, f"{config}-{time.monotonic_ns()}")
    result_file = out + ".json"
    argv = [sys.executable, os.path.abspath(__file__), "--worker", config, "--out", out,
            "--layers", str(opts.layers), "--hidden", str(opts.hidden), "--vocab", str(opts.vocab),
            "--seq", str(opts.seq), "--batch", str(opts.batch), "--steps", str(opts.steps), "--every", str(opts.every)]
    env = {**os.environ, "FLASHCKPT_JOB_ID": os.path.basename(out)}
    if opts.threads:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    proc = subprocess.run([*argv, "--json", result_file], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(result_file) as f:
        result = json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    return result


def report(samples: list[dict], opts: argparse.Namespace) -> bool:
    by = {c: [s for s in samples if s["config"] == c] for c in CONFIGS}
    # config rate / no_checkpoint rate of the same round, median over rounds
    paired = {c: statistics.median(s["steps_per_s"] / b["steps_per_s"] for s, b in zip(by[c], by["no_checkpoint"]))
              for c in CONFIGS}
    params = samples[0]["params"]
    ckpt_gb = params * 4 * 3 / 1e9  # weights + two AdamW moments, float32
    print(f"\nGPT-2 with {params / 1e6:.1f}M parameters (checkpoint about {ckpt_gb:.2f} GB), {opts.steps} steps, "
          f"batch {opts.batch}x{opts.seq}, a checkpoint every {opts.every} steps, {opts.repeats} round(s), "
          f"torch threads {opts.threads or 'default (one per core)'}, {os.cpu_count()} cores; "
          f"'vs no_checkpoint': median over rounds of the ratio within a round\n")
    print(f"| {'config':<14} | {'train() s':>9} | {'loop s':>7} | {'end wait s':>10} | {'steps/s':>8} | "
          f"{'vs no_checkpoint':>16} | {'stall/ckpt s':>12} | {'checkpoints':>11} |")
    print(f"|{'-' * 16}|{'-' * 10}:|{'-' * 8}:|{'-' * 11}:|{'-' * 9}:|{'-' * 17}:|{'-' * 13}:|{'-' * 12}:|")
    ratios = {}
    for config in CONFIGS:
        runs = by[config]
        rate = statistics.median(s["steps_per_s"] for s in runs)
        wall = statistics.median(s["wall_s"] for s in runs)
        loop = statistics.median(s["loop_s"] for s in runs)
        end = statistics.median(s["final_wait_s"] for s in runs)
        stalls = [x for s in runs for x in s["stalls_s"]]
        stall = f"{statistics.median(stalls):.3f}" if stalls else "-"
        ratios[config] = paired[config]
        print(f"| {config:<14} | {wall:9.1f} | {loop:7.1f} | {end:10.2f} | {rate:8.3f} | {paired[config]:15.3f}x | "
              f"{stall:>12} | {len(runs[-1]['checkpoints']):>11} |")
    ok = ratios["flash"] >= TARGET
    print(f"\nflash throughput {ratios['flash']:.3f}x no_checkpoint (target >= {TARGET}): {'PASS' if ok else 'FAIL'}; "
          f"flash_overlap {ratios['flash_overlap']:.3f}x; stock Trainer {ratios['trainer']:.3f}x")
    return ok


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        result = run_worker(opts)
        with open(opts.json, "w") as f:
            json.dump(result, f)
        return 0
    root = opts.dir or tempfile.mkdtemp(prefix="bench-hf-")
    os.makedirs(root, exist_ok=True)
    samples = []
    try:
        for round_ in range(opts.repeats):
            for i in range(len(CONFIGS)):
                config = CONFIGS[(i + round_) % len(CONFIGS)]
                result = run_one(config, opts, root)
                samples.append(result)
                print(f"round {round_ + 1} {config:<14} {result['wall_s']:7.1f}s  stalls "
                      f"{[round(x, 3) for x in result['stalls_s']]}", flush=True)
    finally:
        if opts.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(samples, f, indent=1)
    return 0 if report(samples, opts) else 1


if __name__ == "__main__":
    sys.exit(main())
