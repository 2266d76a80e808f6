"""Device-agnostic helpers for snapshots of accelerator tensors (CUDA and others alike)."""

from __future__ import annotations

from typing import Any

import torch


def on_device(plan: Any) -> bool:
    return any(r.source.device.type != "cpu" for r in plan.regions)


def devices(plan: Any) -> set[torch.device]:
    return {r.source.device for r in plan.regions if r.source.device.type != "cpu"}


def record_device_events(plan: Any) -> list[Any]:
    """Mark, on each device's current stream, the point the snapshot must see."""
    events = []
    for device in devices(plan):
        module = torch.get_device_module(device.type)
        event = module.Event()
        event.record(module.current_stream(device))
        events.append(event)
    return events


def wait_device_events(events: list[Any]) -> None:
    for event in events:
        event.synchronize()


def synchronize_devices(plan: Any) -> None:
    for device in devices(plan):
        torch.get_device_module(device.type).synchronize(device)
