"""Restore loaded objects into live state: copy tensors in place, matching by structure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._utils.devices import synchronize_current
from ..errors import LayoutMismatchError
from .state import FileSpec


def is_files(target: Any) -> bool:
    return isinstance(target, Mapping) and all(isinstance(v, FileSpec) for v in target.values()) and bool(target)


def copy_into_target(files: dict[str, Any], target_files: Mapping[str, Any],
                     locations: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Copy loaded tensors into the target's; the rest are cloned.

    With ``locations`` (storage ``data_ptr`` -> saved location, from a load that kept every
    storage in the slot) the loaded tensors are host views of the slot: each is copied straight
    into its target (host-to-device, asynchronous from a page-locked slot: no second copy of the
    state on the device), and one that has no target is cloned onto its saved device. Returns
    once every copy has landed (the slot may be reused after).
    """
    out = {}
    touched: list[torch.Tensor] = []
    with torch.no_grad():
        for path, loaded in files.items():
            target = target_files.get(path)
            target = target.obj if isinstance(target, FileSpec) else target
            out[path] = _merge(loaded, target, path, locations, touched)
    synchronize_current(touched)
    return out


def _merge(loaded: Any, target: Any, where: str, locations: Mapping[int, str] | None = None,
           touched: list[torch.Tensor] | None = None) -> Any:
    """Copy ``loaded`` tensors into ``target``'s, matching by structure; clone the rest (under no_grad)."""
    if isinstance(loaded, torch.Tensor):
        if isinstance(target, torch.Tensor):
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise LayoutMismatchError(
                    f"{where}: saved tensor is {tuple(loaded.shape)} {loaded.dtype}, the target is "
                    f"{tuple(target.shape)} {target.dtype}"
                )
            if target.is_cpu:
                target.copy_(loaded)
                return target
            async_copy = loaded.is_cpu
            target.copy_(loaded, non_blocking=async_copy)
            if async_copy and touched is not None:
                touched.append(target)
            return target
        location = locations.get(loaded.untyped_storage().data_ptr()) if locations else None
        with torch.set_grad_enabled(loaded.requires_grad):  # a clone keeps requires_grad, as it would outside
            if location is not None and not location.startswith("cpu"):
                return loaded.to(torch.device(location), copy=True)
            return loaded.clone()
    if isinstance(loaded, Mapping):
        items = {k: _merge(v, target.get(k) if isinstance(target, Mapping) else None, f"{where}.{k}",
                           locations, touched)
                 for k, v in loaded.items()}
        try:
            return type(loaded)(items)
        except TypeError:
            return items
    if isinstance(loaded, (list, tuple)) and not hasattr(loaded, "_fields"):
        targets = target if isinstance(target, (list, tuple)) and len(target) == len(loaded) else [None] * len(loaded)
        return type(loaded)(_merge(v, t, f"{where}[{i}]", locations, touched)
                            for i, (v, t) in enumerate(zip(loaded, targets)))
    return loaded
