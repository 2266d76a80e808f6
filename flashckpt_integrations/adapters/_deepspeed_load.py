"""DeepSpeed's model-states loader without its on-disk check, for loading from shared memory."""

from __future__ import annotations

from typing import Any

from ..errors import FlashCkptError

try:
    from deepspeed.runtime.state_dict_factory import MegatronSDLoader
except ImportError as exc:  # pragma: no cover - exercised only without deepspeed
    from ..errors import missing_dependency

    raise missing_dependency("deepspeed", "deepspeed") from exc


class MemorySDLoader(MegatronSDLoader):
    """DeepSpeed's model-states loader without its check that the file exists on disk."""

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any) -> Any:
        quantize = kwargs.get("quantize", args[2] if len(args) > 2 else False)
        if len(self.ckpt_list) != mp_world_size or quantize:
            return super().load(mp_world_size, mp_rank, *args, **kwargs)
        path = self.ckpt_list[mp_rank]
        return path, self.checkpoint_engine.load(path, map_location=lambda storage, loc: storage), (None, 1)


def memory_sd_loader(ckpt_list: list[str], checkpoint_engine: Any, sd_type: str = "Megatron",
                     version: Any = None) -> Any:
    """Stands in for ``SDLoaderFactory.get_sd_loader`` while a snapshot is served from memory."""
    if sd_type != "Megatron":
        raise FlashCkptError(f"{sd_type} checkpoints cannot be loaded from memory")
    return MemorySDLoader(ckpt_list, version, checkpoint_engine)
