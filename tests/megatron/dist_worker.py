"""Megatron-LM's real save_checkpoint / load_checkpoint with ``--ckpt-format torch_dist`` on CPU ranks (gloo).

    torchrun --nproc-per-node 2 tests/megatron/dist_worker.py --mode crash --base DIR --out DIR --layouts tp2,dp2

One launch runs several layouts one after another (Megatron re-initialised for each), each in its
own checkpoint directory ``<base>/<layout>``. Modes (each writes ``<out>/<mode>-<rank>.json``:
``{layout: record}``):

* ``crash`` (patched): per layout, 6 iterations, each saved (overlapped copy), iteration 4
  persisted, 5 and 6 in memory only; 2 more iterations without saving (the uninterrupted
  reference). Then SIGKILL of every rank; with ``killpersist`` as the last layout, the kill comes
  from it: TP=2 in ``<base>/killpersist``, iteration 2 persisted and committed, iteration 4
  persisting through a slow storage when the node's saver and then every rank are SIGKILLed.
* ``resume`` (patched): ``load_checkpoint`` after ``crash`` (from memory), 2 iterations, a
  persisted save of iteration 8.
* ``stock``: Megatron's own code only (any import of flashckpt_integrations is refused and
  recorded). ``--jobs DIR:SAVED:LOADED,...`` loads the newest iteration of ``<base>/DIR`` (saved
  with layout SAVED) with Megatron's ``load_checkpoint`` into layout LOADED.
* ``reshard-crash`` (patched, 4 ranks): per layout (``dp``, ``distopt``; ``dp-torch`` in the
  legacy format), iterations 1-3 saved, 2 persisted, 3 in memory only, then SIGKILL.
* ``reshard-resume`` (patched, 2 ranks): ``load_checkpoint`` after ``reshard-crash`` (from the 4
  ranks' memory), one iteration and its save; records the state in a form that does not depend on
  the data-parallel size, and the WARNINGs of flashckpt_integrations.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import logging
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REFUSED: list[str] = []


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses (and records) imports of flashckpt_integrations: the stock mode proves it runs without it."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "flashckpt_integrations":
            REFUSED.append(name)
            raise ImportError(f"{name} must not be imported by the stock Megatron worker")
        return None


if "stock" in sys.argv:  # before Megatron (and torch's plugin discovery) imports anything
    sys.meta_path.insert(0, _Refuse())

import tiny_gpt as tiny  # noqa: E402  (applies the CPU shims)
import torch  # noqa: E402
from megatron.training import checkpointing, get_args  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"


def argv(layout: str, ckpt: str) -> list[str]:
    # the distributed-optimizer job also loads through Megatron's fully-parallel load wrapper
    extra = ["--ckpt-fully-parallel-load"] if layout in ("dp2", "distopt") else []
    if layout.endswith("-torch"):  # the layout with Megatron's legacy format
        return tiny.megatron_argv(layout[:-len("-torch")], ckpt, ckpt_format="torch")
    return [*tiny.megatron_argv(layout, ckpt, ckpt_format="torch_dist"), *extra]


def save_every(model, optimizer, scheduler):
    def save(iteration: int) -> None:
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)
    return save


def crash(layout: str, ckpt: str, record: dict) -> None:
    from flashckpt_integrations.adapters import megatron as flash_megatron

    flash = flash_megatron.patch(persist_interval=4, config={"async_snapshot": True})
    try:
        model, optimizer, scheduler = tiny.build(seed=7)
        statuses = {}

        def save(iteration: int) -> None:
            checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)
            statuses[iteration] = flash.last_save.status.value

        tiny.train(model, optimizer, scheduler, 1, 6, save)
        outcome = flash.wait()  # iteration 4 is committed; 5 and 6 are in memory only
        record["committed"] = [outcome.step, outcome.committed, outcome.error]
        record["status"] = statuses
        record["saved"] = tiny.digest(model, optimizer)
        tiny.train(model, optimizer, scheduler, 7, 8)
        record["reference"] = tiny.digest(model, optimizer)
    finally:
        flash_megatron.unpatch(close=False)  # the memory must outlive this process
        KEEP.append(flash)


KEEP: list = []


def load_recorded(flash, record: dict) -> tuple:
    """A fresh model loaded by the patched ``load_checkpoint``; what it loaded, from where, how fast: in ``record``."""
    model, optimizer, scheduler = tiny.build(seed=99)
    started = time.perf_counter()
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["load_s"] = time.perf_counter() - started
    record["loaded_iteration"], record["loaded_flops"] = iteration, flops
    record["source"] = flash.last_load
    return model, optimizer, scheduler, iteration


def resume(layout: str, ckpt: str, record: dict) -> None:
    from flashckpt_integrations.adapters import megatron as flash_megatron

    flash = flash_megatron.patch(persist_interval=4)
    try:
        model, optimizer, scheduler, iteration = load_recorded(flash, record)
        record["loaded"] = tiny.digest(model, optimizer)
        tiny.train(model, optimizer, scheduler, iteration + 1, 8)
        record["final"] = tiny.digest(model, optimizer)
        record["final_global"] = tiny.global_digest(model, optimizer if layout != "dp2" else None)
        checkpointing.save_checkpoint(8, model, optimizer, scheduler, 800)
        outcome = flash.wait()
        record["committed"] = [outcome.step, outcome.committed, outcome.error]
    finally:
        flash_megatron.unpatch()


def killpersist(layout: str, ckpt: str, record: dict) -> None:
    from flashckpt_integrations.adapters import megatron as flash_megatron
    from tests.helpers import saver_pids

    # every data file the saver writes waits $FLASHCKPT_TEST_WRITE_DELAY first: the kill lands mid-persist
    flash = flash_megatron.patch(persist_interval=2, config={"storage_factory": "tests.helpers:SlowStorage"})
    model, optimizer, scheduler = tiny.build(seed=7)
    save = save_every(model, optimizer, scheduler)
    tiny.train(model, optimizer, scheduler, 1, 2, save)
    outcome = flash.wait()
    record["committed"] = [outcome.step, outcome.committed, outcome.error]
    record["saved"] = tiny.digest(model, optimizer)
    tiny.train(model, optimizer, scheduler, 3, 4, save)
    record["persisting"] = flash.last_save.status.value
    ck = flash.checkpointer(get_args().save)
    staging = os.path.join(ck.url, ".flashckpt", "staging")
    deadline = time.monotonic() + 60
    while not any(n.startswith("4.") for n in _listdir(staging)) and time.monotonic() < deadline:
        time.sleep(0.01)  # the saver has claimed iteration 4 and is writing its files (slowly)
    record["tracker_before_kill"] = open(os.path.join(ck.url, TRACKER)).read()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        record["killed_savers"] = saver_pids(ck.run_dir)
        for pid in record["killed_savers"]:
            os.kill(pid, signal.SIGKILL)
    write_record("crash", RECORDS)
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def reshard_crash(layout: str, ckpt: str, record: dict) -> None:
    """4 ranks: iterations 1-3, each saved; 2 persisted, 3 in memory only. Then the kill (main)."""
    from flashckpt_integrations.adapters import megatron as flash_megatron

    flash = flash_megatron.patch(persist_interval=2)
    try:
        model, optimizer, scheduler = tiny.build(seed=7)
        tiny.train(model, optimizer, scheduler, 1, 3, save_every(model, optimizer, scheduler))
        outcome = flash.wait()  # iteration 2 is committed; 3 is in memory only
        record["committed"] = [outcome.step, outcome.committed, outcome.error]
        record["status"] = flash.last_save.status.value
        record.update(reshard_state(layout, model, optimizer))
    finally:
        flash_megatron.unpatch(close=False)  # the memory must outlive this process
        KEEP.append(flash)


def reshard_resume(layout: str, ckpt: str, record: dict) -> None:
    """2 ranks after ``reshard_crash``: load (``torch_dist``: from the 4 ranks' memory), one iteration, a save
    (persisted after a load of iteration 3)."""
    from flashckpt_integrations.adapters import megatron as flash_megatron

    flash = flash_megatron.patch(persist_interval=2)
    logged = Logged()
    logging.getLogger("flashckpt_integrations").addHandler(logged)
    try:
        model, optimizer, scheduler, iteration = load_recorded(flash, record)
        record.update(reshard_state(layout, model, optimizer))
        tiny.train(model, optimizer, scheduler, iteration + 1, iteration + 1)
        checkpointing.save_checkpoint(iteration + 1, model, optimizer, scheduler, 100 * (iteration + 1))
        outcome = flash.wait()  # (None: the save was not persisted)
        record["committed"] = outcome and [outcome.step, outcome.committed, outcome.error]
        record["committed_steps"] = flash.checkpointer(get_args().save).committed_steps()
    finally:
        record["warnings"] = logged.messages  # (also when the load failed: why it read storage)
        logging.getLogger("flashckpt_integrations").removeHandler(logged)
        flash_megatron.unpatch()


class Logged(logging.Handler):
    """Keeps the messages of the WARNINGs (and worse) of flashckpt_integrations."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def reshard_state(layout: str, model, optimizer) -> dict:
    """What a resume onto another data-parallel size must restore, in a form that does not depend on it."""
    args = get_args()
    distributed = args.use_distributed_optimizer
    state = {"global": tiny.global_digest(model, None if distributed else optimizer),
             "consumed_train_samples": args.consumed_train_samples, "data_parallel_size": args.data_parallel_size,
             "rng": tiny.rng_digest()}
    if distributed:
        state["optimizer_global"] = tiny.distributed_optimizer_digest(model, optimizer)
    return state


def stock(job: str, record: dict) -> None:
    name, saved, loaded = job.split(":")
    record["flashckpt_imported"] = sorted(m for m in sys.modules if m.startswith("flashckpt_integrations"))
    record["flashckpt_refused"] = list(REFUSED)
    model, optimizer, scheduler = tiny.build(seed=99)
    iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["loaded_iteration"] = iteration
    record["loaded"] = tiny.digest(model, optimizer)
    record["loaded_global"] = tiny.global_digest(model, optimizer if "dp2" not in (saved, loaded) else None)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


OUT = ""
RECORDS: dict = {}


def write_record(mode: str, records: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"{mode}-{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(records, f)


def guarded(run, record: dict, *args) -> None:
    try:
        run(*args, record)
    except Exception as exc:  # the test reads what went wrong from the record
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()


def main() -> int:
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("crash", "resume", "stock", "reshard-crash", "reshard-resume"),
                        required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", default="")
    parser.add_argument("--jobs", default="")
    opts = parser.parse_args()
    OUT = opts.out
    records = RECORDS
    if opts.mode == "stock":
        for job in opts.jobs.split(","):
            name, _, loaded = job.split(":")
            tiny.start(argv(loaded, os.path.join(opts.base, name)))
            guarded(stock, records.setdefault(job, {}), job)
    else:
        modes = {"crash": crash, "resume": resume, "reshard-crash": reshard_crash, "reshard-resume": reshard_resume}
        for item in opts.layouts.split(","):
            run = killpersist if item == "killpersist" else modes[opts.mode]
            layout = "tp2" if item == "killpersist" else item
            tiny.start(argv(layout, os.path.join(opts.base, item)))
            guarded(run, records.setdefault(item, {}), layout, os.path.join(opts.base, item))
    write_record(opts.mode, records)
    torch.distributed.barrier()
    if opts.mode in ("crash", "reshard-crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
