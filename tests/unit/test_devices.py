"""The device-independent half of the accelerator path: what CPU tests can see (issue 19, items 6-10).

Unsupported devices are refused before a slot is touched, a failed overlapped copy is reported,
overlapped saves with nothing waiting for them warn, and ``prepare()`` never remaps a slot under
an overlapped copy.
"""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

from flashckpt_integrations.core.checkpointer import saving as engine_module
from flashckpt_integrations.core.results import SaveStatus
from flashckpt_integrations.core.shm_buffer import SlotState
from flashckpt_integrations.core.state import Codec, FileSpec
from tests.helpers import run_python


def _states(ck):
    slots = map(ck.slots.mapped, ck.slots.indices())
    return [slot.read_header().state for slot in slots if slot is not None and slot.read_header()]


META_CASES = {
    "torch": (lambda: {"state": {"model": torch.nn.Linear(2, 2, device="meta").state_dict()}}, "['model']['weight']"),
    "safetensors": (lambda: {"files": {"m.safetensors": FileSpec({"w": torch.empty(4, device="meta")},
                                                                 Codec.SAFETENSORS)}}, "'w'"),
    "parts": (lambda: {"files": {"m.distcp": FileSpec([b"head", torch.empty(4, device="meta")], Codec.PARTS)}},
              "part 1"),
}


@pytest.mark.parametrize("codec", sorted(META_CASES))
def test_a_meta_tensor_is_refused_by_name_before_the_slot_is_touched(make_checkpointer, codec):
    make, where = META_CASES[codec]
    ck = make_checkpointer()
    assert ck.save(1, {"a": torch.ones(3)}, persist=False).ok
    assert ck.save(2, {"a": torch.full((3,), 2.0)}, persist=False).ok
    with pytest.raises(ValueError, match="meta") as info:
        ck.save(3, persist=False, **make())
    assert where in str(info.value), info.value
    assert SlotState.WRITING not in _states(ck)
    assert ck.memory_steps() == [1, 2]  # neither snapshot was touched
    loaded = ck.load()
    assert loaded.step == 2 and loaded.source == "memory" and torch.equal(loaded.state["a"], torch.full((3,), 2.0))
    assert ck.save(4, {"a": torch.zeros(3)}, persist=False).ok  # and the checkpointer goes on


def test_prepare_refuses_a_meta_tensor_too(make_checkpointer):
    ck = make_checkpointer()
    with pytest.raises(ValueError, match=r"\['w'\].*meta"):
        ck.prepare({"w": torch.empty(3, device="meta")})


@pytest.mark.parametrize("persist", [False, True])
def test_a_failed_overlapped_copy_is_reported_not_in_memory(make_checkpointer, monkeypatch, persist):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = make_checkpointer(optimizers=[opt], async_snapshot=True)
    assert ck.save(1, {"model": model.state_dict()}, persist=False).ok
    assert ck.wait_for_snapshot() is None  # a copy that worked reports nothing

    def broken(*args, **kwargs):
        raise RuntimeError("simulated copy error")

    monkeypatch.setattr(engine_module, "copy_regions", broken)
    result = ck.save(2, {"model": model.state_dict()}, persist=persist)
    error = ck.wait_for_snapshot()  # what optimizer.step()'s pre-hook calls: it reports, never raises
    assert error is not None and "simulated copy error" in error
    assert result.status is SaveStatus.FAILED and not result.ok
    assert "simulated copy error" in result.reason
    outcome = result.wait(30)
    assert not outcome.committed and "simulated copy error" in outcome.error
    monkeypatch.undo()
    assert ck.memory_steps() == [1]
    assert ck.load().step == 1
    opt.step()  # the hook does not raise for an already reported failure
    assert ck.save(3, {"model": model.state_dict()}, persist=False).ok


def test_result_wait_alone_reports_a_failed_overlapped_copy(make_checkpointer, monkeypatch):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    ck = make_checkpointer(optimizers=[opt], async_snapshot=True)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated copy error")

    monkeypatch.setattr(engine_module, "copy_regions", broken)
    result = ck.save(1, {"w": torch.ones(4)}, persist=False)
    outcome = result.wait(30)
    assert not outcome.committed and "simulated copy error" in (outcome.error or "")
    assert result.status is SaveStatus.FAILED


def test_overlapped_saves_with_no_optimizer_to_wait_warn_once(make_checkpointer, tmp_path, caplog):
    def said():
        return [r for r in caplog.records if "attach_optimizer" in r.getMessage() and r.levelname == "WARNING"]

    ck = make_checkpointer(async_snapshot=True)
    for step in range(3):
        assert ck.save(step, {"w": torch.ones(4)}, persist=False).ok
        ck.wait_for_snapshot()
    assert len(said()) == 1
    # per call too, and not at all once an optimizer waits for the copy
    caplog.clear()
    other = make_checkpointer(tmp_path / "other")
    other.save(1, {"w": torch.ones(4)}, persist=False, async_snapshot=True)
    other.wait_for_snapshot()
    assert len(said()) == 1
    caplog.clear()
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    waited = make_checkpointer(tmp_path / "waited", optimizers=[opt], async_snapshot=True)
    waited.save(1, {"w": torch.ones(4)}, persist=False)
    waited.save(2, {"w": torch.ones(4)}, persist=False, async_snapshot=False)
    waited.wait_for_snapshot()
    assert not said()


def test_the_accelerate_adapter_attaches_its_optimizers_for_overlapped_saves(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from flashckpt_integrations.adapters.accelerate import AccelerateCheckpointer

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path)))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    flash = AccelerateCheckpointer(accelerator, tmp_path / "ckpt", config={"async_snapshot": True})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert flash.save_state(1, persist=False).ok
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()  # the pre-hook waits for the copy
            assert flash.save_state(2, persist=False).ok
        assert not [w for w in caught if "attach_optimizer" in str(w.message)]
        assert len(flash.checkpointer.saves.hooks) == 1  # attached once, not once per save
        assert optimizer.optimizer._optimizer_step_pre_hooks, "optimizer.step() does not wait for the copy"
    finally:
        flash.checkpointer.close()


PREPARE_UNDER_COPY = textwrap.dedent("""
    import sys
    import torch
    from flashckpt_integrations import Checkpointer

    ck = Checkpointer(sys.argv[1], job_id=sys.argv[2], async_snapshot=True)
    state = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(32)}  # 512 MiB
    for attempt in range(3):
        result = ck.save(attempt, state, persist=False)
        ck.prepare(nbytes=(3 + attempt) * 600 << 20)  # grows both slots while the copy runs
        assert ck.wait_for_snapshot() is None
        assert result.ok, result
        loaded = ck.load(attempt).state
        for i in range(32):
            assert torch.equal(loaded[f"t{i}"], state[f"t{i}"]), (attempt, i)
    ck.close()
    print("OK")
""")


def test_prepare_does_not_remap_a_slot_under_an_overlapped_copy(tmp_path):
    import uuid

    proc = run_python(PREPARE_UNDER_COPY, str(tmp_path / "ckpt"), f"prep-{uuid.uuid4().hex[:8]}", timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
