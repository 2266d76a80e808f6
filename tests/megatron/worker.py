"""A tiny Megatron GPT on 2 CPU ranks, trained with Megatron-LM's real checkpointing (patched or stock).

    torchrun --nproc-per-node 2 tests/megatron/worker.py --layout tp2 --ckpt DIR --out DIR --mode roundtrip

Modes (each writes ``<out>/rank-<r>.json``):

* ``roundtrip``: a reference run of 6 iterations; then, from the same seed, 4 iterations saved
  through the patch (memory every iteration, persisted every 2nd); unpatch; a fresh model loads
  the newest commit with Megatron's *stock* ``load_checkpoint`` and trains 2 more iterations. The
  record holds the saved / loaded / final parameters and optimizer states (as checksums).
* ``crash``: 6 iterations snapshotted every iteration (persisted every 4th), then 2 more without
  saving (the reference), then SIGKILL of every rank.
* ``resume``: the patched ``load_checkpoint`` after ``crash``, then 2 iterations.
* ``load``: the patched ``load_checkpoint`` only (the error, if any, goes into the record).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tiny_gpt  # noqa: E402  (applies the CPU shims)
import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402
from megatron.training import checkpointing, get_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from tiny_gpt import LAYOUTS, build, cpu_shims, digest, train  # noqa: E402,F401

from flashckpt_integrations.adapters import megatron as flash_megatron  # noqa: E402


def megatron_argv(layout: str, ckpt: str, **sizes: int) -> list[str]:
    return tiny_gpt.megatron_argv(layout, ckpt, **sizes)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    opts = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = [sys.argv[0], *megatron_argv(opts.layout, opts.ckpt)]
    parse_and_validate_args()
    with cpu_shims.fake_cuda_device_count():
        initialize_megatron(allow_no_cuda=True)
    rank = torch.distributed.get_rank()
    record: dict = {"rank": rank, "dp_rank": mpu.get_data_parallel_rank()}
    try:
        MODES[opts.mode](record)
    except Exception as exc:  # the test reads what went wrong from the record
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def roundtrip(record: dict) -> None:
    model, optimizer, scheduler = build(seed=7)
    train(model, optimizer, scheduler, 1, 6)
    record["reference"] = digest(model, optimizer)

    stock = os.environ.get("STOCK_SAVE") == "1"
    flash = None if stock else flash_megatron.patch(persist_interval=2)
    model, optimizer, scheduler = build(seed=7)
    saved = {}

    def save(iteration: int) -> None:
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)
        saved[iteration] = digest(model, optimizer)
        if flash is not None:
            record.setdefault("status", {})[iteration] = flash.last_save.status.value
            record.setdefault("blocking_s", []).append(flash.last_save.blocking_s)

    fault = os.environ.pop("SAVER_FAULT", "")
    if fault:  # armed in the saver that the first save starts, not in the ones restarted after it dies
        os.environ["FLASHCKPT_FAULT"] = fault
        train(model, optimizer, scheduler, 1, 1, save)
        ck = flash.checkpointer(get_args().save)
        while not (os.path.exists(os.path.join(ck.run_dir, "saver.log")) or ck.client.connected):
            time.sleep(0.005)
        os.environ.pop("FLASHCKPT_FAULT")
    train(model, optimizer, scheduler, 2 if fault else 1, 4, save)
    if flash is not None:
        outcome = flash.wait()
        record["committed"] = [outcome.step, outcome.committed, outcome.error]
        flash_megatron.unpatch()  # everything below is stock Megatron
    record["saved"] = saved[4]

    model, optimizer, scheduler = build(seed=99)
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["loaded_iteration"], record["loaded_flops"] = iteration, flops
    record["loaded"] = digest(model, optimizer)
    train(model, optimizer, scheduler, iteration + 1, 6)
    record["final"] = digest(model, optimizer)


def crash(record: dict) -> None:
    # overlapped snapshots: the copy runs while the next iteration's forward and backward do
    flash = flash_megatron.patch(persist_interval=4, config={"async_snapshot": True})
    model, optimizer, scheduler = build(seed=7)

    def save(iteration: int) -> None:
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)

    train(model, optimizer, scheduler, 1, 6, save)
    flash.wait()  # iteration 4 is committed; 5 and 6 are in memory only
    record["saved"] = digest(model, optimizer)
    train(model, optimizer, scheduler, 7, 8)
    record["reference"] = digest(model, optimizer)
    path = os.path.join(sys.argv[sys.argv.index("--save") + 1], f"crash-{torch.distributed.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(record, f)
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(record: dict) -> None:
    flash = flash_megatron.patch(persist_interval=4)
    model, optimizer, scheduler = build(seed=99)
    started = time.perf_counter()
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["load_s"] = time.perf_counter() - started
    record["loaded_iteration"], record["loaded_flops"] = iteration, flops
    record["source"] = flash.last_load
    record["loaded"] = digest(model, optimizer)
    train(model, optimizer, scheduler, iteration + 1, 8)
    record["final"] = digest(model, optimizer)
    flash_megatron.unpatch()


def load(record: dict) -> None:
    flash_megatron.patch()
    model, optimizer, scheduler = build(seed=99)
    try:
        record["loaded_iteration"] = checkpointing.load_checkpoint(model, optimizer, scheduler)[0]
    finally:
        flash_megatron.unpatch()


def dist(record: dict) -> None:
    """megatron-core dist_checkpointing through the flash strategy, read back with the stock loader."""
    from megatron.core import dist_checkpointing

    from flashckpt_integrations.adapters.megatron_core import FlashTorchDistSaveStrategy

    model, optimizer, scheduler = build(seed=7)
    train(model, optimizer, scheduler, 1, 2)
    strategy = FlashTorchDistSaveStrategy()
    directory = os.path.join(get_args().save, "iter_0000002")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    started = time.perf_counter()
    dist_checkpointing.save({"model": unwrap_model(model[0]).sharded_state_dict()}, directory,
                            sharded_strategy=strategy)
    record["blocking_s"] = time.perf_counter() - started
    outcome = strategy.last_save.wait()
    record["committed"] = [outcome.step, outcome.committed, outcome.error]
    record["saved"] = digest(model, optimizer)
    strategy.close()

    fresh, fresh_optimizer, _ = build(seed=99)
    target = unwrap_model(fresh[0])
    loaded = dist_checkpointing.load({"model": target.sharded_state_dict()}, directory)  # stock
    target.load_state_dict(loaded["model"])
    record["loaded"] = {k: v for k, v in digest(fresh, fresh_optimizer).items() if k.startswith("model")}
    record["saved"] = {k: v for k, v in record["saved"].items() if k.startswith("model")}
    record["files"] = sorted(os.listdir(directory))


MODES = {"roundtrip": roundtrip, "crash": crash, "resume": resume, "load": load, "dist": dist}

if __name__ == "__main__":
    sys.exit(main())
