"""A reused DCP plan resolves every item exactly as DCP's planner does, and what it saves loads with stock DCP."""

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from flashckpt_integrations.adapters import dcp as flash_dcp
from tests.helpers import save_lines


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        flash_dcp._plans.clear()


def make_state(mesh, seed, note="short"):
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "a.weight": distribute_tensor(torch.randn(8, 4, generator=gen), mesh, [Shard(0)]),
            "b.weight": distribute_tensor(torch.randn(3, generator=gen), mesh, [Replicate()]),
            "c.param": torch.nn.Parameter(torch.randn(2, 5, generator=gen)),
            "d.buffer": torch.randn(6, generator=gen)[::2],
            "e.scalar": torch.tensor(float(seed)),
        },
        "extra": {"step": seed, "lr": 0.5 * seed, "note": note, "history": [seed, {"x": seed}]},
    }


def test_reused_plan_resolves_items_like_dcp(group):
    flash_dcp.dcp_files(make_state(group, 1))  # plans
    (plan,) = flash_dcp._plans.values()
    state = make_state(group, 2)
    state_dict = {"model": state["model"], "extra": state["extra"]}
    files = flash_dcp.dcp_files(state)  # reuses the plan
    (plan_after,) = flash_dcp._plans.values()
    assert plan_after is plan
    fast = files[plan.name].obj
    slow = flash_dcp._parts_by_planner(plan, state_dict)
    assert len(fast) == len(slow) == len(plan.items)
    for got, want in zip(fast, slow):
        assert type(got) is type(want)
        if isinstance(want, bytes):
            assert got == want
        else:
            assert got.data_ptr() == want.data_ptr() and got.shape == want.shape and got.stride() == want.stride()


def test_saves_through_a_reused_plan_load_with_stock_dcp(group, make_checkpointer, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    ck = make_checkpointer(layout=flash_dcp.LAYOUT)
    core_blocking = {}  # Checkpointer.save's own stall; flash_dcp.save's blocking_s adds the planning to it
    core_save = ck.save

    def save(step, **kwargs):
        result = core_save(step, **kwargs)
        core_blocking[step] = result.blocking_s
        return result

    monkeypatch.setattr(ck, "save", save)
    for step, note in ((1, "short"), (2, "short"), (3, "a note that no longer fits the planned bytes " * 40)):
        result = flash_dcp.save(ck, step, make_state(group, step, note))
        assert result.wait(60).committed, step
    assert len(flash_dcp._plans) == 1 and next(iter(flash_dcp._plans.values())).generation == 1  # replanned once
    for step, note in ((2, "short"), (3, "a note that no longer fits the planned bytes " * 40)):
        target = make_state(group, 0)
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt" / f"step-{step}"))
        want = make_state(group, step, note)
        for key, value in want["model"].items():
            got = target["model"][key]
            assert torch.equal(got.full_tensor() if hasattr(got, "full_tensor") else got,
                               value.full_tensor() if hasattr(value, "full_tensor") else value.detach()), (step, key)
        assert target["extra"] == want["extra"], step
    ck.close()
    lines = save_lines([r.getMessage() for r in caplog.records], "DCP save")
    expected = [(0, step, "persisting", f"to {tmp_path / 'ckpt' / f'step-{step}'}") for step in (1, 2, 3)]
    assert [line[:4] for line in lines] == expected, lines
    assert all(held + 0.0005 >= core_blocking[step] for _, step, _, _, held in lines), (lines, core_blocking)
