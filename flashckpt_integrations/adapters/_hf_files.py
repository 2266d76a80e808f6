"""The files of a ``Trainer`` checkpoint, built for a snapshot of a
:class:`~flashckpt_integrations.adapters.hf_trainer.FlashCkptTrainer`.

Besides the optimizer, scheduler and RNG states, ``Trainer._save_checkpoint`` writes the weights
(``save_pretrained``'s ``model.safetensors``, or its shards and index), the small files of
``Trainer._save`` (config, generation config, tokenizer, training args) and ``trainer_state.json``.
Here they are built as :class:`~flashckpt_integrations.core.state.FileSpec` for ``Checkpointer.save``:
the weights as views of the live tensors (:func:`weight_files`), the small files by letting the
stock code write them into a scratch folder (:func:`small_files`, :class:`ConfigFiles`), and
``trainer_state.json`` byte for byte as ``TrainerState.save_to_json`` writes it (:func:`trainer_state_file`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ..core.state import Codec, FileSpec
from ..errors import missing_dependency
from ._common import files_written_by, quiet_about

try:
    import transformers
    from transformers import PreTrainedModel, Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise missing_dependency("transformers", "hf") from exc

# File names of a Trainer checkpoint (stable across transformers 4.x and 5.x).
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
MAX_SHARD_SIZE = "50GB"
"""``save_pretrained``'s default, which ``Trainer`` uses: bigger models are split the same way."""

WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


def unwrapped_model(trainer: Trainer) -> Any:
    """The trainer's model without accelerate's wrappers (DDP, FSDP, ``torch.compile``)."""
    model = trainer.model
    if isinstance(model, PreTrainedModel):
        return model
    try:
        return trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
    except TypeError:  # older accelerate
        return trainer.accelerator.unwrap_model(model)


def weight_files(trainer: Trainer, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, FileSpec]:
    """The weight files ``save_pretrained`` (or ``Trainer._save``) writes, of ``state_dict`` (a full state
    dict) or as views of the live tensors."""
    model = unwrapped_model(trainer)
    if isinstance(model, PreTrainedModel):
        state_dict = model.state_dict() if state_dict is None else dict(state_dict)
        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
            state_dict.pop(key, None)
        state_dict = _without_tied_weights(state_dict, model)
    else:
        state_dict = dict(trainer.model.state_dict() if state_dict is None else state_dict)
    if not getattr(trainer.args, "save_safetensors", True):  # transformers 4.x option
        return {WEIGHTS_NAME: FileSpec(state_dict)}
    metadata = {"format": "pt"}
    shards = _split_into_shards(state_dict)
    if shards is None:
        return {SAFE_WEIGHTS_NAME: FileSpec(state_dict, Codec.SAFETENSORS, metadata=metadata)}
    files, index = shards
    out = {name: FileSpec(part, Codec.SAFETENSORS, metadata=metadata) for name, part in files.items()}
    if isinstance(model, PreTrainedModel):
        index["metadata"] = {"total_parameters": model.num_parameters(), **index["metadata"]}
    out[SAFE_WEIGHTS_INDEX_NAME] = FileSpec((json.dumps(index, indent=2, sort_keys=True) + "\n").encode(),
                                            Codec.BYTES)
    return out


def small_files(write: Callable[[str], Any]) -> dict[str, FileSpec]:
    """Let the stock code ``write(directory)`` its small files; return them as byte files."""
    # dummy weights of state_dict={} are skipped: the real ones come from memory
    return files_written_by(write, skip=lambda rel: rel in WEIGHT_FILES)


class ConfigFiles:
    """What ``Trainer._save`` writes besides the weights: config, generation config, tokenizer,
    training args; the last ones written, kept for the snapshots that do not write them afresh."""

    def __init__(self) -> None:
        self._files: dict[str, FileSpec] | None = None

    def get(self, save: Callable[..., Any], refresh: bool) -> dict[str, FileSpec]:
        """The files that ``save`` (the trainer's ``_save``: ``Trainer._save`` or a subclass's) writes:
        afresh with ``refresh`` (a persisting save) or when none were written yet, else the last ones.

        A memory-only snapshot carries the last ones (they do not change while training), so that a
        snapshot persisted from memory (after a crash or on SIGTERM) is a checkpoint ``from_pretrained``
        and a stock resume read.
        """
        if refresh or self._files is None:
            self._files = small_files(lambda directory: _save_quietly(save, directory))
        return dict(self._files)


def _save_quietly(save: Callable[..., Any], directory: str) -> None:
    """``Trainer._save`` without the weights: config, generation config, tokenizer, training args.

    Its "Saving model checkpoint to <directory>" would name a scratch folder: it is left out.
    """
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    loggers = [name for name in list(logging.Logger.manager.loggerDict)
               if name == "transformers" or name.startswith("transformers.")]
    try:
        with quiet_about(directory, loggers):
            save(directory, state_dict={})
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def best_checkpoint(trainer: Trainer, step: int, persist: bool) -> str | None:
    """``best_model_checkpoint`` as ``_save_checkpoint`` sets it (the folder exists once committed);
    a persisted save sets it in the live state too."""
    state, args = trainer.state, trainer.args
    best = state.best_model_checkpoint
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy in ("steps", "epoch", "best") and state.best_global_step:
        best_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if (persist and state.best_global_step == step) or os.path.exists(best_dir):
            best = best_dir
            if persist:
                state.best_model_checkpoint = best_dir
    return best


def trainer_state_file(trainer: Trainer, persist: bool, best_model_checkpoint: str | None) -> bytes:
    """``trainer_state.json`` byte for byte as ``TrainerState.save_to_json`` writes it.

    A persisted save updates the live state's callback states as ``_save_checkpoint`` does; a
    memory snapshot records the same content without touching the live state.
    """
    state = trainer.state
    stateful = state.stateful_callbacks if persist else copy.deepcopy(state.stateful_callbacks)
    exportable = _exportable_state_class()
    if exportable is not None:
        callbacks = trainer.callback_handler.callbacks + [trainer.control]
        for cb in [cb for cb in callbacks if isinstance(cb, exportable)]:
            name = cb.__class__.__name__
            if isinstance(stateful.get(name), list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()
    data = dataclasses.asdict(state)
    data["stateful_callbacks"] = copy.deepcopy(stateful)
    data["best_model_checkpoint"] = best_model_checkpoint
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _exportable_state_class() -> type | None:
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:  # pragma: no cover - transformers < 4.41 has no stateful callbacks
        return None
    return ExportableState


def _without_tied_weights(state_dict: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Drop tied duplicates as ``save_pretrained`` does (safetensors stores no aliases)."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        remove_tied_weights_from_state_dict = None
    if remove_tied_weights_from_state_dict is not None:
        state_dict = remove_tied_weights_from_state_dict(state_dict, model)
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return state_dict
        return revert_weight_conversion(model, state_dict)
    # transformers 4.x: keep the first name of each group of tensors sharing memory, preferring
    # names that are not declared tied (the ones from_pretrained ties back)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    groups: dict[tuple[Any, int, int], list[str]] = {}
    for name, tensor in state_dict.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        groups.setdefault(key, []).append(name)
    out = dict(state_dict)
    for names in groups.values():
        if len(names) > 1:
            keep = sorted(names, key=lambda n: (any(n.endswith(t) for t in tied), n))[0]
            for name in names:
                if name != keep:
                    del out[name]
    return out


def _split_into_shards(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, dict], dict] | None:
    """Shards and index as ``save_pretrained`` makes them; None when the model fits one file."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    if not split.is_sharded:
        return None
    files = {name: {k: state_dict[k] for k in keys} for name, keys in split.filename_to_tensors.items()}
    return files, {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
