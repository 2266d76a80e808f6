"""A training script shaped like HuggingFace's ``examples/pytorch/language-modeling/run_clm.py``,
with ``Trainer(`` replaced by ``FlashCkptTrainer(``: arguments parsed into dataclasses and
``TrainingArguments`` by ``HfArgumentParser``, the resume flag taken as the command line gives it
(``checkpoint = training_args.resume_from_checkpoint``), ``trainer.train(resume_from_checkpoint=checkpoint)``,
then ``trainer.save_model()`` and the metrics, as the example does.

    python tests/hf/example_script.py --output_dir OUT --max_steps 20 --save_steps 5 \\
        [--resume_from_checkpoint True|OUT/checkpoint-10] [--flash_memory_interval 3] \\
        [--kill_at S] [--result FILE]

``--kill_at S``: SIGKILL right after the memory-only snapshot of step S. ``--pause_at S``: wait there
(prints ``{"paused_at": S}``) until SIGTERM, which ends the process or, with
``--enable_jit_checkpoint True``, lets the step run on to JIT's save at its end. ``--stock``: the same run with
``transformers.Trainer`` in a process that never imports flashckpt_integrations. ``--flash_config``:
FlashCkptTrainer's ``flash_config`` as JSON. Prints one JSON line when training begins (what it
resumed from) and one at the end; writes the final weights to ``--result``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from tests.hf.common import FixedData, parameters, tiny_gpt2  # noqa: E402


@dataclass
class ScriptArguments:
    flash_memory_interval: int | None = field(default=None, metadata={"help": "memory-only snapshots"})
    kill_at: int | None = field(default=None, metadata={"help": "SIGKILL after the snapshot of this step"})
    result: str | None = field(default=None, metadata={"help": "write the final weights here"})
    pause_at: int | None = field(default=None, metadata={"help": "wait for SIGTERM after the snapshot of this step"})
    stock: bool = field(default=False, metadata={"help": "transformers.Trainer, without flashckpt_integrations"})
    flash_config: str | None = field(default=None, metadata={"help": "FlashCkptTrainer's flash_config, as JSON"})
    step_sleep: float = field(default=0.0, metadata={"help": "seconds each step sleeps; each step prints a line"})


class ReportResume(TrainerCallback):
    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        print(json.dumps({"resumed_from": getattr(self.trainer, "flash_resumed_from", None),
                          "start_step": state.global_step}), flush=True)


class Progress(TrainerCallback):
    """Before each step: ``{"at": steps done, "snapshot": the newest step a restart could resume}``."""

    def __init__(self, trainer, sleep: float) -> None:
        self.trainer, self.sleep = trainer, sleep

    def on_step_begin(self, args, state, control, **kwargs):
        last = getattr(self.trainer, "flash_last_save", None)
        if hasattr(self.trainer, "flash_last_save"):
            snapshot = last.step if last is not None and last.ok else None
        else:  # the stock Trainer: its newest checkpoint folder
            newest = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
            snapshot = int(newest.rsplit("-", 1)[1]) if newest else None
        print(json.dumps({"at": state.global_step, "snapshot": snapshot}), flush=True)
        time.sleep(self.sleep)


class PauseAt(TrainerCallback):
    """At step S (its snapshot taken), wait for SIGTERM; with JIT checkpointing, go on once it asked to save."""

    def __init__(self, trainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        self.trainer.flash_checkpointer.wait_for_snapshot()
        jit = next((cb.jit_manager for cb in self.trainer.callback_handler.callbacks
                    if getattr(cb, "jit_manager", None) is not None), None)
        print(json.dumps({"paused_at": self.step, "run_dir": self.trainer.flash_checkpointer.run_dir}), flush=True)
        while not getattr(jit, "signalled", False):
            time.sleep(0.02)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s", level=logging.INFO, stream=sys.stderr)
    transformers.utils.logging.set_verbosity_info()
    if script_args.stock:
        trainer = Trainer(model=tiny_gpt2(), args=training_args, train_dataset=FixedData())
    else:
        from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer
        from tests.hf.train_script import KillAfterSnapshot

        trainer = FlashCkptTrainer(model=tiny_gpt2(), args=training_args, train_dataset=FixedData(),
                                   flash_memory_interval=script_args.flash_memory_interval,
                                   flash_config=json.loads(script_args.flash_config or "{}"))
        if script_args.kill_at is not None:
            trainer.add_callback(KillAfterSnapshot(trainer, script_args.kill_at))
        if script_args.pause_at is not None:
            trainer.add_callback(PauseAt(trainer, script_args.pause_at))
    trainer.add_callback(ReportResume(trainer))
    if script_args.step_sleep:
        trainer.add_callback(Progress(trainer, script_args.step_sleep))
    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
        if script_args.stock and checkpoint in ("True", "true"):  # as run_clm.py finds it
            checkpoint = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) \
                else None
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    if script_args.result:
        torch.save(parameters(trainer.model), script_args.result)
    print(json.dumps({"final_step": trainer.state.global_step,
                      "imported_flashckpt": any(m.startswith("flashckpt_integrations") for m in sys.modules)}),
          flush=True)


if __name__ == "__main__":
    main()
