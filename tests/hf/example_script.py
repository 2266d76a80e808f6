"""A training script shaped like HuggingFace's ``examples/pytorch/language-modeling/run_clm.py``,
with ``Trainer(`` replaced by ``FlashCkptTrainer(``: arguments parsed into dataclasses and
``TrainingArguments`` by ``HfArgumentParser``, the resume flag taken as the command line gives it
(``checkpoint = training_args.resume_from_checkpoint``), ``trainer.train(resume_from_checkpoint=checkpoint)``,
then ``trainer.save_model()`` and the metrics, as the example does.

    python tests/hf/example_script.py --output_dir OUT --max_steps 20 --save_steps 5 \\
        [--resume_from_checkpoint True|OUT/checkpoint-10] [--flash_memory_interval 3] \\
        [--kill_at S] [--result FILE]

``--kill_at S``: SIGKILL right after the memory-only snapshot of step S. Prints one JSON line when
training begins (what it resumed from) and one at the end; writes the final weights to ``--result``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.hf.common import FixedData, parameters, tiny_gpt2  # noqa: E402
from tests.hf.train_script import KillAfterSnapshot  # noqa: E402


@dataclass
class ScriptArguments:
    flash_memory_interval: int | None = field(default=None, metadata={"help": "memory-only snapshots"})
    kill_at: int | None = field(default=None, metadata={"help": "SIGKILL after the snapshot of this step"})
    result: str | None = field(default=None, metadata={"help": "write the final weights here"})


class ReportResume(TrainerCallback):
    def __init__(self, trainer: FlashCkptTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        print(json.dumps({"resumed_from": self.trainer.flash_resumed_from, "start_step": state.global_step}),
              flush=True)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s", level=logging.INFO, stream=sys.stderr)
    transformers.utils.logging.set_verbosity_info()
    trainer = FlashCkptTrainer(model=tiny_gpt2(), args=training_args, train_dataset=FixedData(),
                               flash_memory_interval=script_args.flash_memory_interval)
    trainer.add_callback(ReportResume(trainer))
    if script_args.kill_at is not None:
        trainer.add_callback(KillAfterSnapshot(trainer, script_args.kill_at))
    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    if script_args.result:
        torch.save(parameters(trainer.model), script_args.result)
    print(json.dumps({"final_step": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
