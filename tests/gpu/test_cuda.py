"""The accelerator path: device-to-host snapshots into page-locked slots. Skips without a GPU."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_device_tensors_round_trip_and_come_back_on_their_device(make_checkpointer):
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda").half(),
             "cpu": torch.ones(3)}
    ck = make_checkpointer()
    assert ck.save(1, state).wait(120).committed
    for prefer_memory in (True, False):
        loaded = ck.load(prefer_memory=prefer_memory).state
        assert loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])
        assert torch.equal(loaded["b"], state["b"]) and torch.equal(loaded["cpu"], state["cpu"])
    assert any(slot is not None and slot._pinned for slot in ck._slots)


def test_overlapped_device_snapshot_waits_for_pending_kernels(make_checkpointer):
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = make_checkpointer(optimizers=[opt], async_snapshot=True)
    with torch.no_grad():
        model.weight.mul_(2.0)  # queued on the stream; the snapshot must see it
    expected = model.weight.detach().clone()
    ck.save(1, {"model": model.state_dict()}, persist=False)
    model(torch.randn(64, 2048, device="cuda")).sum().backward()
    opt.step()  # waits for the copy
    loaded = ck.load(1, map_location="cpu").state
    assert torch.equal(loaded["model"]["weight"], expected.cpu())
