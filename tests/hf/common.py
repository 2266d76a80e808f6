"""A tiny GPT-2 and fixed data for the HuggingFace Trainer tests (no hub access)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed  # noqa: E402

SEQ_LEN, N_EXAMPLES, BATCH = 16, 64, 4  # 16 optimizer steps per epoch


class FixedData(torch.utils.data.Dataset):
    """The same token sequences in every process; the Trainer's sampler shuffles them (seeded)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (N_EXAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    set_seed(42)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))


def training_args(output_dir: str, *, max_steps: int, save_steps: int, **extra) -> TrainingArguments:
    return TrainingArguments(
        output_dir, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
        per_device_train_batch_size=BATCH, learning_rate=1e-3, logging_steps=1, seed=42, report_to="none",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **extra,
    )


def make_trainer(cls, output_dir: str, *, max_steps: int, save_steps: int, args: dict | None = None, **kwargs):
    return cls(model=tiny_gpt2(), args=training_args(output_dir, max_steps=max_steps, save_steps=save_steps,
                                                     **(args or {})),
               train_dataset=FixedData(), **kwargs)


def parameters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ: {different}"


class FailAt(TrainerCallback):
    """Raise (a failure in the training loop, not a crash) at the end of optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("injected failure")
