"""State wrappers keyed by the original model's FQNs, for one module or a rank's pipeline stages.

With ``torch.distributed.pipelining`` each rank holds one (or, with interleaved schedules, several)
stage modules. Build a stage as the model with the other stages' layers removed (as torchtitan
does), so that its parameters keep the unsplit model's names; then

```python
state = {"model": ModelState(stage_modules), "optimizer": OptimizerState(stage_modules, optimizers)}
flash_dcp.save(ck, step, state)      # one collective save: every stage at once, one DCP checkpoint
flash_dcp.load(ck, state)            # into any number of stages: keys are FQNs, never stage indices
```

The optimizer state is flattened by parameter name (``flatten_optimizer_state_dict``), so the
``param_groups`` of different stages never collide and a checkpoint of 2 stages loads into 1.
See ``examples/pipeline/pippy_dcp.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import missing_dependency

try:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.stateful import Stateful
except ImportError as exc:  # pragma: no cover - torch built without distributed
    raise missing_dependency("torch.distributed.checkpoint", "dcp") from exc

__all__ = ["ModelState", "OptimizerState", "as_stateful"]


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


class ModelState(Stateful):
    """A model's (or a rank's pipeline stages') state dict keyed by the original model's FQNs."""

    def __init__(self, model: nn.Module | Iterable[nn.Module], options: StateDictOptions | None = None) -> None:
        self.modules = _modules(model)
        self.options = options or StateDictOptions()
        self._keys: list[set[str]] = []

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._keys = []
        for module in self.modules:
            part = get_model_state_dict(module, options=self.options)
            self._keys.append(set(part))
            out.update(part)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = self._keys or [set(get_model_state_dict(m, options=self.options)) for m in self.modules]
        for module, own in zip(self.modules, keys):
            set_model_state_dict(module, {k: v for k, v in state_dict.items() if k in own}, options=self.options)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter FQN (``flatten_optimizer_state_dict``), never by index.

    ``model`` and ``optimizer`` may be lists of equal length (one optimizer per pipeline stage).
    """

    def __init__(
        self,
        model: nn.Module | Iterable[nn.Module],
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        options: StateDictOptions | None = None,
    ) -> None:
        self.modules = _modules(model)
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if len(self.modules) != len(self.optimizers) and len(self.optimizers) != 1:
            raise ValueError(f"got {len(self.modules)} modules and {len(self.optimizers)} optimizers; pass one "
                             "optimizer for all modules, or one per module")
        self.options = options or StateDictOptions(flatten_optimizer_state_dict=True)
        if not self.options.flatten_optimizer_state_dict and len(self.modules) > 1:
            raise ValueError("several modules need flatten_optimizer_state_dict=True (param_groups would collide)")

    def _pairs(self) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        if len(self.optimizers) == 1 and len(self.modules) > 1:
            return [(_Stages(self.modules), self.optimizers)]
        return [(m, [o]) for m, o in zip(self.modules, self.optimizers)]

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for module, optimizers in self._pairs():
            out.update(get_optimizer_state_dict(module, optimizers, options=self.options))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for module, optimizers in self._pairs():
            set_optimizer_state_dict(module, optimizers, state_dict, options=self.options)


class _Stages(nn.Module):
    """Several stage modules seen as one (their FQNs are already the original model's)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self._stages = modules

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        for module in self._stages:
            yield from module.named_parameters(*args, **kwargs)


def as_stateful(state: Mapping[str, Any]) -> dict[str, Any]:
    """Wrap ``nn.Module`` values in :class:`ModelState` and optimizers in :class:`OptimizerState`."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of {{name: module, optimizer, Stateful or state dict}}, got "
                        f"{type(state).__name__}")
    models = [v for v in state.values() if isinstance(v, nn.Module)]
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            out[name] = ModelState(value)
        elif isinstance(value, torch.optim.Optimizer):
            if len(models) != 1:
                raise ValueError(f"{name!r} is an optimizer but the state holds {len(models)} modules; wrap it as "
                                 "OptimizerState(model, optimizer) to say which model it optimizes")
            out[name] = OptimizerState(models[0], value)
        else:
            out[name] = value
    return out
