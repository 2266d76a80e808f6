"""The DCP adapter's restore from storage: each .distcp file read once, verified, values as stock dcp.load's."""

import glob
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flashckpt_integrations import Checkpointer, CorruptCheckpointError
from flashckpt_integrations.adapters import dcp as flash_dcp
from tests.helpers import CountingStorage, flip_file_byte


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        flash_dcp._plans.clear()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])  # 12 MiB of parameters


def test_dcp_restore_from_storage_reads_each_file_once_and_falls_back_past_a_changed_file(group, tmp_path):
    ck = Checkpointer(tmp_path / "ck", flash_dcp.checkpointer_config(storage_factory="tests.helpers:CountingStorage"))
    try:
        model = _model(0)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 512)).sum().backward()
        optimizer.step()
        state = {"model": model, "optimizer": optimizer, "extra": {"epoch": 3, "seen": torch.arange(7)}}
        assert flash_dcp.save(ck, 1, state).status.value in ("persisting", "committed")
        assert ck.wait(60).committed
        first = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2)
        flash_dcp.save(ck, 2, state)
        assert ck.wait(60).committed
        second = {k: v.clone() for k, v in model.state_dict().items()}
        stock = _model(5).state_dict()
        dcp.load({"model": stock}, checkpoint_id=str(tmp_path / "ck" / "step-2"))  # stock reader, stock files

        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        CountingStorage.data_bytes.clear()
        result = flash_dcp.load(ck, state, prefer_memory=False)
        assert (result.step, result.source, result.fallbacks) == (2, "storage", [])
        for key, value in second.items():
            assert torch.equal(model.state_dict()[key], value), key
            assert torch.equal(stock[key], value), key
        distcp = glob.glob(str(tmp_path / "ck" / "step-2" / "*.distcp"))
        assert len(distcp) == 1 and os.path.getsize(distcp[0]) > 12 << 20
        name = f"step-2/{os.path.basename(distcp[0])}"
        assert CountingStorage.data_bytes[name] == os.path.getsize(distcp[0]), "the file is read once, by ranges"
        assert not [k for k in CountingStorage.data_bytes if k.endswith(".distcp") and k != name]

        flip_file_byte(distcp[0], at=0.5)
        result = flash_dcp.load(ck, state, prefer_memory=False)
        assert result.step == 1 and len(result.fallbacks) == 1 and "checksum" in result.fallbacks[0], result
        for key, value in first.items():
            assert torch.equal(model.state_dict()[key], value), key
        with pytest.raises(CorruptCheckpointError, match="step 2"):
            flash_dcp.load(ck, state, step=2, prefer_memory=False)
    finally:
        ck.close()
