"""FSDP1 and FSDP2 full state dicts through the flash layer; the files load into a plain module."""

import json

import pytest
import torch

from tests.dcp.fsdp_train import build_model
from tests.dcp.launch import torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("version", [1, 2])
def test_full_state_dict_round_trip_and_plain_module_load(tmp_path, version):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run = torchrun("fsdp_full.py", "--ckpt", ckpt, "--out", out, "--fsdp", version)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["committed"] and result["files"] == ["model.safetensors", "optimizer.pt"]
    for source in ("memory", "storage"):  # back into fresh sharded models on every rank
        assert result[source] == {"step": 2, "source": source, "equal": True, "trains_on": True}

    # the files alone, into an unsharded module and a plain optimizer
    expected = torch.load(out / "expected.pt", weights_only=True)
    plain = build_model()
    weights = safetensors_torch.load_file(ckpt / "step-2" / "model.safetensors")
    plain.load_state_dict(weights, strict=True)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, expected["model"][name]), name
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer.load_state_dict(torch.load(ckpt / "step-2" / "optimizer.pt", weights_only=True))
    names = [name for name, _ in plain.named_parameters()]
    loaded = optimizer.state_dict()
    assert [g["param_names"] for g in loaded["param_groups"]] == [names]
    for index, name in enumerate(names):
        for key, value in expected["optimizer"]["state"][name].items():
            assert torch.equal(loaded["state"][index][key], value), (name, key)
