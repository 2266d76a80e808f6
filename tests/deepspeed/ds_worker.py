"""One rank of the DeepSpeed tests (run under torchrun with DS_ACCELERATOR=cpu).

Phases (``--phase``), each over the ZeRO stages given by ``--stages``, one directory per stage:

* ``train``: train to step 2 and save (persisted), to step 3 and save (memory only), wait for the
  commit, keep training to step 5 without saving and record the parameters; also save step 2 with
  the stock engine into ``<stock>/stage<S>``. ``--kill`` ends with SIGKILL on every rank.
* ``resume``: (a) flash engine loads step 3 from memory and trains to 5; (b) stock DeepSpeed loads
  step 2 from the saver's files and trains to 5; (c) the flash engine, its memory freed, loads
  step 2 from storage and trains to 5; (d) zero_to_fp32 consolidates step 2. Every final state
  must equal the uninterrupted run's, bit for bit.
* ``bad``: an overlapped (``async_snapshot``) save reloads equal; then a non-step tag, a save on rank 0 only.
  Records the INFO log messages of the phase (``logs``) and the saves' ``blocking_s``.

Each rank writes ``<out>/rank-<r>.json`` with what it saw.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashckpt_integrations.adapters import deepspeed as flash_ds  # noqa: E402


def build(stage: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_to(engine, step: int) -> None:
    while engine.global_steps < step:
        g = torch.Generator().manual_seed(1000 * (engine.global_steps + 1) + dist.get_rank())
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


def full_params(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):
        return {name: p.detach().clone() for name, p in params}


def save_reference(params: dict[str, torch.Tensor], out: str, name: str) -> None:
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(out, name))
    dist.barrier()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(-1), b[k].view(-1).to(a[k].dtype)) for k in a)


def phase_train(args, stage: int, ckpt: str, rec: dict) -> None:
    engine = build(stage, seed=0)
    flash = flash_ds.enable(engine, ckpt, persist_interval=2)
    assert engine.load_checkpoint(ckpt) == (None, None)  # nothing there yet: stock behaviour
    train_to(engine, 2)
    first = engine.save_checkpoint(ckpt)
    save_reference(full_params(engine), args.out, f"step2-stage{stage}.pt")
    engine.save_checkpoint(os.path.join(args.stock, f"stage{stage}"))  # outside the flash directory: stock
    train_to(engine, 3)
    second = engine.save_checkpoint(ckpt)
    committed = flash.wait()
    train_to(engine, 5)
    save_reference(full_params(engine), args.out, f"ref-stage{stage}.pt")
    rec[stage] = {"first": [first.step, first.status.value], "second": [second.step, second.status.value],
                  "committed": [committed.step, committed.committed]}


def phase_resume(args, stage: int, ckpt: str, rec: dict) -> None:
    ref = torch.load(os.path.join(args.ref, f"ref-stage{stage}.pt"))
    out = rec[stage] = {}
    engine = build(stage, seed=1)
    flash = flash_ds.enable(engine, ckpt, persist_interval=2)
    path, client = engine.load_checkpoint(ckpt)
    out["memory"] = [*flash.last_load, engine.global_steps]
    train_to(engine, 5)
    out["memory_equal"] = equal(full_params(engine), ref)
    flash.close()

    engine = build(stage, seed=2)  # stock DeepSpeed reads what the saver wrote
    path, _ = engine.load_checkpoint(ckpt)
    out["stock"] = [os.path.basename(path) if path else None, engine.global_steps]
    train_to(engine, 5)
    out["stock_equal"] = equal(full_params(engine), ref)

    engine = build(stage, seed=3)
    flash = flash_ds.enable(engine, ckpt, persist_interval=2)
    engine.load_checkpoint(ckpt)
    out["storage"] = [*flash.last_load, engine.global_steps]
    train_to(engine, 5)
    out["storage_equal"] = equal(full_params(engine), ref)
    flash.close()

    if stage > 0 and dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        step2 = torch.load(os.path.join(args.ref, f"step2-stage{stage}.pt"))
        out["zero_to_fp32_equal"] = equal({k: consolidated[k] for k in step2}, step2)


def check_async_snapshot(stage: int, ckpt: str, rec: dict) -> None:
    """With async_snapshot the copy overlaps training; the next optimizer step waits for it."""
    engine = build(stage, seed=0)
    flash = flash_ds.enable(engine, ckpt, config={"async_snapshot": True})
    train_to(engine, 2)
    at_save = full_params(engine)
    result = engine.save_checkpoint(ckpt)
    rec["blocking_s"] = {str(result.step): result.blocking_s}
    train_to(engine, 4)  # changes the parameters only after the snapshot copy is done
    committed = flash.wait()
    flash.close()
    engine = build(stage, seed=5)
    flash = flash_ds.enable(engine, ckpt)
    engine.load_checkpoint(ckpt)
    rec["async"] = [result.status.value, committed.committed, flash.last_load, equal(full_params(engine), at_save)]
    flash.close()


class Messages(logging.Handler):
    """Every log message of this process at INFO and above (propagated to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def phase_bad(args, stage: int, ckpt: str, rec: dict) -> None:
    messages = Messages()
    logging.getLogger().addHandler(messages)
    logging.getLogger("flashckpt_integrations").setLevel(logging.INFO)
    rec["logs"] = messages.messages
    check_async_snapshot(stage, ckpt + "-async", rec)
    engine = build(stage, seed=0)
    flash = flash_ds.enable(engine, ckpt, barrier_timeout_s=3)
    train_to(engine, 1)
    try:
        engine.save_checkpoint(ckpt, tag="best")
        rec["tag"] = None
    except ValueError as exc:
        rec["tag"] = str(exc)
    if dist.get_rank() == 0:
        try:
            engine.save_checkpoint(ckpt)
            rec["one_rank"] = None
        except Exception as exc:
            rec["one_rank"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    rec["memory_steps"] = flash.checkpointer.memory_steps()
    flash.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", required=True, choices=["train", "resume", "bad"])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--stock", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ref", default="", help="directory of the train phase's reference parameters")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--kill", action="store_true")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    rec: dict = {}
    phase = {"train": phase_train, "resume": phase_resume, "bad": phase_bad}[args.phase]
    try:
        for stage in map(int, args.stages.split(",")):
            phase(args, stage, os.path.join(args.ckpt, f"stage{stage}"), rec)
    except Exception:
        rec["error"] = traceback.format_exc()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.kill and "error" not in rec:
        dist.barrier()  # both ranks are done before either dies
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1 if "error" in rec else 0)


if __name__ == "__main__":
    sys.exit(main())
