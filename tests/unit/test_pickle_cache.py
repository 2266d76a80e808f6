"""A save reuses the previous save's pickle while the structure stays (state.PickleCache).

The pickle it reuses, with this save's ints and floats written in, must be the bytes a fresh
pickle would be; anything it cannot take is pickled anew; files on storage still load with a
stock ``torch.load``.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap

import torch

from flashckpt_integrations.core.state import PickleCache, normalize_files, plan_snapshot
from tests.helpers import assert_same, rich_state


def _training_state(step: int, lr: float, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    shared = model[0].weight.detach()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1000 + step,
            "loss": 2.5 / step, "neg": -step, "big": 2**40 + step, "lr": lr, "shared": [shared, shared, shared[1:]],
            "tags": ("run", None, True), "nested": collections.OrderedDict(a=[step, float(step)])}


def _training(steps: int):
    """``(step, state)`` after each of ``steps`` AdamW steps with a decaying lr;
    the state is built afresh each time, as a training script builds it for each save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    for step in range(1, steps + 1):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        yield step, _training_state(step, scheduler.get_last_lr()[0], model, optimizer)


def _blob(files: dict, pickles: PickleCache | None = None) -> bytes:
    (plan,) = plan_snapshot(normalize_files(files), pickles).files
    return plan.blob


def test_a_reused_pickle_is_the_fresh_pickle_of_this_save():
    pickles = PickleCache()
    for _, state in _training(5):  # fresh dicts every save
        assert _blob({"x.pt": state}, pickles) == _blob({"x.pt": state})
    assert pickles.hits == 4


def test_what_the_previous_pickle_cannot_take_is_pickled_anew():
    pickles = PickleCache()
    w = torch.randn(4, 4)
    states = [
        {"w": w, "n": 255, "m": 65535, "x": 2**31 - 1},
        {"w": w, "n": 256, "m": 65536, "x": 2**31},  # each int outgrows its encoding
        {"w": w, "n": 256, "m": 65536, "x": 2**31, "new": 1},  # a new key
        {"w": w.view(2, 8), "n": 256, "m": 65536, "x": 2**31, "new": 1},  # another shape
        {"w": w.clone(), "n": 256, "m": 65536, "x": 2**31, "new": w},  # sharing changed
        {"w": w.clone(), "n": 256, "m": 65536, "x": 2**31, "new": w.clone()},
        dict({"w": w.clone()}),
        collections.OrderedDict({"w": w.clone()}),  # another container type
        {"w": w.double()},  # another dtype
        {"w": torch.nn.Parameter(w)},  # not a plain tensor: never reused
        {"w": torch.nn.Parameter(w)},
    ]
    for state in states:
        blob = _blob({"x.pt": state}, pickles)
        assert blob == _blob({"x.pt": state}), state
    assert pickles.hits == 1  # the only save of the same structure as the one before it: "new": w.clone()
    rich = PickleCache()
    for seed in range(3):  # classes, bytes, sets: pickled every time, and right
        state = rich_state(seed)
        assert _blob({"x.pt": state}, rich) == _blob({"x.pt": state})
    assert rich.hits == 0


def test_reused_pickles_restore_from_memory_and_load_with_stock_torch(make_checkpointer, tmp_path):
    ck = make_checkpointer()
    for step, state in _training(4):
        result = ck.save(step, state, persist=step == 4)
        assert result.ok, result.reason
        assert_same(ck.load(step).state, state)
    assert ck.saves.pickles.hits == 3
    assert result.wait(60).committed
    code = textwrap.dedent("""
        import json, sys, torch
        (path,) = sys.argv[1:]
        obj = torch.load(path, weights_only=True)
        assert "flashckpt_integrations" not in sys.modules
        print(json.dumps({"step": obj["step"], "lr": obj["lr"], "neg": obj["neg"], "big": obj["big"],
                          "group_lr": obj["optimizer"]["param_groups"][0]["lr"], "nested": obj["nested"]["a"],
                          "shared": obj["shared"][0] is obj["shared"][1],
                          "w": obj["model"]["0.weight"].flatten().tolist()}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt" / "step-4" / "rank-0.pt")],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout)
    assert got == {"step": 1004, "lr": state["lr"], "neg": -4, "big": 2**40 + 4,
                   "group_lr": state["optimizer"]["param_groups"][0]["lr"], "nested": [4, 4.0], "shared": True,
                   "w": state["model"]["0.weight"].flatten().tolist()}


def test_prepare_makes_the_first_saves_pickle(make_checkpointer):
    """``prepare(state)`` pickles the state ahead: the first save reuses that pickle with its own
    values (another step, lr, loss), and restores them."""
    ck = make_checkpointer()
    states = dict(_training(3))
    ck.prepare(states[1])
    assert ck.saves.pickles.hits == 0
    result = ck.save(3, states[3], persist=False)
    assert result.ok, result.reason
    assert ck.saves.pickles.hits == 1
    restored = ck.load(3).state
    assert_same(restored, states[3])
    assert (restored["step"], restored["loss"], restored["nested"]["a"]) == (1003, 2.5 / 3, [3, 3.0])


def test_prepare_returns_once_the_saver_has_mapped_the_slots(make_checkpointer):
    """``prepare()`` waits for the node's saver to map the slots it made, so that mapping does not
    share the CPU with the first save (read from the saver's own ``/proc/PID/maps``)."""
    ck = make_checkpointer()
    ck.client.connect()
    ck.client.request({"op": "ping"}).result(60)
    ck.prepare({"w": torch.zeros(1 << 20)})
    with open(f"/proc/{ck.client.saver_pid}/maps") as f:
        mapped = f.read()
    assert all(path in mapped for path in ck.slot_paths), (ck.slot_paths, mapped[-2000:])
