"""TRL's SFTTrainer, DPOTrainer or GRPOTrainer on a tiny model, in its own process (run by tests/hf/test_trl.py,
which also imports the builders).

    python tests/hf/trl_script.py --trainer sft|dpo|grpo --out DIR --result FILE [--plain] [--count-steps]
        [--kill-at S] [--resume]
    python -m torch.distributed.run --nproc-per-node 2 tests/hf/trl_script.py ...   (DDP, gloo)

The model, the tokenizer and the datasets are built in memory (random weights, nothing downloaded).
``--plain``: the stock TRL trainer; otherwise ``class T(FlashCkptTrainer, SFTTrainer)``. ``--count-steps``
adds state of the trainer's own to its checkpoints (:class:`tests.hf.extra_state.CountSteps`).
``--kill-at S``: rank 0 SIGKILLs itself right after the memory-only snapshot of step S. At the end
rank 0 writes the final parameters to ``FILE`` and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, set_seed  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from flashckpt_integrations.adapters.hf_trainer import FlashCkptTrainer  # noqa: E402
from tests.helpers import exit_without_teardown  # noqa: E402
from tests.hf.common import parameters  # noqa: E402
from tests.hf.extra_state import CountSteps  # noqa: E402
from tests.hf.train_script import KillAfterSnapshot  # noqa: E402

WORDS = "the a cat dog bird sat ran flew on over under mat log tree far and then slept".split()
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
STOCK = {"sft": SFTTrainer, "dpo": DPOTrainer, "grpo": GRPOTrainer}


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_lm() -> GPT2LMHeadModel:
    set_seed(42)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(VOCAB),
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1))


def _sentences(n: int, low: int, high: int, seed: int) -> list[str]:
    draw = random.Random(seed)
    return [" ".join(draw.choice(WORDS) for _ in range(draw.randint(low, high))) for _ in range(n)]


def sft_data() -> Dataset:
    return Dataset.from_dict({"text": _sentences(64, 4, 12, seed=0)})


def dpo_data() -> Dataset:
    prompts = _sentences(32, 2, 5, seed=1)
    return Dataset.from_dict({"prompt": prompts, "chosen": _sentences(32, 2, 4, seed=2),
                              "rejected": _sentences(32, 2, 4, seed=3)})


def grpo_data() -> Dataset:
    return Dataset.from_dict({"prompt": _sentences(32, 2, 5, seed=4)})


def longer_is_better(completions: list[str], **_) -> list[float]:
    return [float(len(c)) for c in completions]


def make_trainer(kind: str, cls: type, out: str, *, max_steps: int, save_steps: int, **kwargs):
    """A TRL trainer of ``kind`` (``cls``: the stock class, or one composed with FlashCkptTrainer).

    GRPO: 2 completions of 4 tokens per prompt, and the adaptive entropy control, whose state
    (``entropy_ctrl_state.json``) GRPOTrainer keeps in its checkpoints.
    """
    config = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig}[kind]
    extra_args = {"num_generations": 2, "max_completion_length": 4, "use_adaptive_entropy": True,
                  "entropy_target": 10.0} if kind == "grpo" else {}
    args = config(out, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
                  per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, seed=42, report_to="none",
                  use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **extra_args)
    data = {"sft": sft_data, "dpo": dpo_data, "grpo": grpo_data}[kind]()
    extra = {"ref_model": tiny_lm()} if kind == "dpo" else {"reward_funcs": longer_is_better} if kind == "grpo" else {}
    return cls(model=tiny_lm(), args=args, train_dataset=data, processing_class=tokenizer(), **extra, **kwargs)


def trainer_class(kind: str, plain: bool, count_steps: bool) -> type:
    base = STOCK[kind]
    if count_steps:
        base = type(f"Counted{base.__name__}", (CountSteps, base), {})
    return base if plain else type(f"Flash{base.__name__}", (FlashCkptTrainer, base), {})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=sorted(STOCK), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--memory-interval", type=int, default=3)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--plain", action="store_true", help="the stock TRL trainer")
    parser.add_argument("--count-steps", action="store_true", help="state of the trainer's own in its checkpoints")
    opts = parser.parse_args()
    cls = trainer_class(opts.trainer, opts.plain, opts.count_steps)
    extra = {} if opts.plain else {"flash_memory_interval": opts.memory_interval}
    trainer = make_trainer(opts.trainer, cls, opts.out, max_steps=opts.max_steps, save_steps=opts.save_steps, **extra)
    if opts.kill_at is not None:
        trainer.add_callback(KillAfterSnapshot(trainer, opts.kill_at))
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    steps_seen = [getattr(trainer, "steps_seen", None)]
    if dist.is_initialized():
        steps_seen = [None] * dist.get_world_size()
        dist.all_gather_object(steps_seen, getattr(trainer, "steps_seen", None))
    if trainer.args.process_index != 0:
        return
    torch.save(parameters(trainer.model), opts.result)
    print(json.dumps({"final_step": trainer.state.global_step, "steps_seen": steps_seen,
                      "resumed_from": getattr(trainer, "flash_resumed_from", None)}), flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
