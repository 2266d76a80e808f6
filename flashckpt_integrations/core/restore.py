"""Restore loaded objects into live state: copy tensors in place, matching by structure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import LayoutMismatchError
from .state import FileSpec


def is_files(target: Any) -> bool:
    return isinstance(target, Mapping) and all(isinstance(v, FileSpec) for v in target.values()) and bool(target)


def copy_into_target(files: dict[str, Any], target_files: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for path, loaded in files.items():
        target = target_files.get(path)
        target = target.obj if isinstance(target, FileSpec) else target
        out[path] = _merge(loaded, target, path)
    return out


def _merge(loaded: Any, target: Any, where: str) -> Any:
    """Copy ``loaded`` tensors into ``target``'s, matching by structure; clone the rest."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(target, torch.Tensor):
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise LayoutMismatchError(
                    f"{where}: saved tensor is {tuple(loaded.shape)} {loaded.dtype}, the target is "
                    f"{tuple(target.shape)} {target.dtype}"
                )
            with torch.no_grad():
                target.copy_(loaded)
            return target
        return loaded.clone()
    if isinstance(loaded, Mapping):
        items = {k: _merge(v, target.get(k) if isinstance(target, Mapping) else None, f"{where}.{k}")
                 for k, v in loaded.items()}
        try:
            return type(loaded)(items)
        except TypeError:
            return items
    if isinstance(loaded, (list, tuple)) and not hasattr(loaded, "_fields"):
        targets = target if isinstance(target, (list, tuple)) and len(target) == len(loaded) else [None] * len(loaded)
        return type(loaded)(_merge(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(loaded, targets)))
    return loaded
