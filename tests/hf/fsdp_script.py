"""Train the tiny GPT-2 under FSDP with the HF Trainer, under torchrun with 2 gloo ranks (run by test_fsdp.py).

    torchrun --nproc-per-node 2 tests/hf/fsdp_script.py --out DIR --result FILE [--plain]
        [--state-dict-type SHARDED_STATE_DICT|FULL_STATE_DICT] [--fsdp-version 1|2] [--flash-config JSON]
        [--kill-at S] [--resume | --resume-from PATH]
        [--then-stock-resume-from PATH --stock-out DIR --stock-result FILE]

On CPU ``TrainingArguments(fsdp=...)`` silently trains with plain DDP, so the trainers here force
accelerate's FSDP plugin after the Trainer built its accelerator (test-only; the package never does
this). ``--plain``: the stock ``transformers.Trainer``; otherwise ``FlashCkptTrainer`` with a
memory-only snapshot every ``--memory-interval`` steps. ``--kill-at S``: rank 0 SIGKILLs itself
right after the memory-only snapshot of step S. ``--then-stock-resume-from``: afterwards, in the same
processes, a stock ``Trainer`` resumes from that checkpoint and trains to the end. Rank 0 saves the
final full parameters (``torch.save``) and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.hf.common import make_trainer  # noqa: E402


class ForcedFsdp:
    """Mixin: turn the Trainer's accelerator into accelerate's FSDP (what ``fsdp=`` does on a GPU machine)."""

    fsdp_version = 2
    state_dict_type = "SHARDED_STATE_DICT"

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        options = {"fsdp_version": self.fsdp_version, "state_dict_type": self.state_dict_type,
                   "auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": "GPT2Block"}
        if self.fsdp_version == 1:  # sync_module_states needs an accelerator device; every rank seeds alike
            options.update(use_orig_params=True, sync_module_states=False)
            # FSDP1 refuses device_id "cpu:0" (accelerate's CPU device) for modules on "cpu"
            PartialState._shared_state["device"] = self.accelerator.state.device = torch.device("cpu")
        state = self.accelerator.state
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**options)
        state.distributed_type = DistributedType.FSDP
        # every AcceleratorState() copies PartialState's distributed_type back: set it there too, as accelerate
        # does when it builds an FSDP state itself
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


class StockFsdpTrainer(ForcedFsdp, Trainer):
    pass


class FlashFsdpTrainer(ForcedFsdp, FlashCkptTrainer):
    pass


class KillAfterSnapshot(TrainerCallback):
    def __init__(self, trainer: FlashCkptTrainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        last = self.trainer.flash_last_save
        assert last is not None and last.step == self.step and last.status.value == "in_memory", last
        self.trainer.flash_checkpointer.wait_for_snapshot()  # an overlapped copy (async_snapshot) is done
        dist.barrier()  # every rank holds the snapshot; then rank 0 dies and torchrun ends the other
        if args.process_index == 0:
            print(json.dumps({"killing_at": self.step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def full_parameters(model) -> dict[str, torch.Tensor]:
    """The unsharded parameters on every rank (collective; no CPU offload, which FSDP1 cannot do on CPU)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def train(cls, opts, out: str, resume) -> Trainer:
    cls.state_dict_type, cls.fsdp_version = opts.state_dict_type, opts.fsdp_version
    extra = {} if cls is StockFsdpTrainer else {"flash_memory_interval": opts.memory_interval,
                                                "flash_config": json.loads(opts.flash_config)}
    trainer = make_trainer(cls, out, max_steps=opts.max_steps, save_steps=opts.save_steps, **extra)
    if opts.kill_at is not None and cls is FlashFsdpTrainer:
        trainer.add_callback(KillAfterSnapshot(trainer, opts.kill_at))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--fsdp-version", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--memory-interval", type=int, default=3)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--flash-config", default="{}", help="FlashCkptTrainer's flash_config, as JSON")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--plain", action="store_true", help="the stock transformers.Trainer")
    parser.add_argument("--then-stock-resume-from")
    parser.add_argument("--stock-out")
    parser.add_argument("--stock-result")
    opts = parser.parse_args()
    trainer = train(StockFsdpTrainer if opts.plain else FlashFsdpTrainer, opts, opts.out,
                    opts.resume_from or (True if opts.resume else None))
    summary = {"final_step": trainer.state.global_step,
               "resumed_from": getattr(trainer, "flash_resumed_from", None),
               "model": type(trainer.model).__name__}
    params = full_parameters(trainer.model)
    if dist.get_rank() == 0:
        torch.save(params, opts.result)
    if opts.then_stock_resume_from:
        stock = train(StockFsdpTrainer, opts, opts.stock_out, opts.then_stock_resume_from)
        summary["stock_final_step"] = stock.state.global_step
        params = full_parameters(stock.model)
        if dist.get_rank() == 0:
            torch.save(params, opts.stock_result)
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo threads left running can abort the interpreter at exit
