"""A saver that cannot open the storage answers every rank: ``wait()`` reports why, ``close()`` returns.

The saver is a separate process. Three ways it can fail to open what the trainer opened fine: a
storage factory importable only in the trainer, a scheme registered with ``register_storage``
only in the trainer, a backend that raises when the saver opens it.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from flashckpt_integrations import Checkpointer
from flashckpt_integrations.core.storage import LocalStorage, register_storage


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(step)), "b": torch.arange(step, step + 8)}


def _close_within(ck: Checkpointer, seconds: float) -> None:
    closer = threading.Thread(target=ck.close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), "close() did not return"


def _saves_report(ck: Checkpointer, expected: str) -> None:
    for step in (1, 2):  # the failure is reported every time, and training goes on
        result = ck.save(step, _state(step))
        assert result.ok, result.reason
        outcome = result.wait(90)
        assert not outcome.committed
        assert "could not open the storage" in outcome.error and expected in outcome.error, outcome.error
    assert ck.committed_steps() == []
    assert ck.memory_steps() == [1, 2]  # the snapshots themselves are fine
    assert torch.equal(ck.load(2).state["w"], _state(2)["w"])
    persisted = ck.wait(30)
    assert persisted is not None and not persisted.committed


def test_a_factory_importable_only_in_the_trainer(tmp_path, monkeypatch):
    extra = tmp_path / "only_here"
    extra.mkdir()
    (extra / "trainer_only_storage.py").write_text(
        "from flashckpt_integrations.core.storage import LocalStorage\n"
        "def make(url, **options):\n    return LocalStorage(url)\n"
    )
    monkeypatch.setattr(sys, "path", [*sys.path, str(extra)])  # not the script's folder: that goes along
    ck = Checkpointer(tmp_path / "ckpt", storage_factory="trainer_only_storage:make")
    _saves_report(ck, "must be importable in the saver")
    _close_within(ck, 60)


def test_a_scheme_registered_only_in_the_trainer(tmp_path):
    root = tmp_path / "ckpt"
    register_storage("trainerlocal", lambda url, **options: LocalStorage(url.split("://", 1)[1]))
    ck = Checkpointer(f"trainerlocal://{root}")
    _saves_report(ck, "register_storage()")
    _close_within(ck, 60)


def test_a_backend_that_raises_when_the_saver_opens_it(tmp_path):
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, storage_factory="tests.helpers:storage_refused_after_start")
    root.mkdir(parents=True, exist_ok=True)
    (root / "DENY").write_text("")
    _saves_report(ck, "refused the connection")
    _close_within(ck, 60)
    os.unlink(root / "DENY")


def test_a_factory_beside_the_training_script_works_in_the_saver(tmp_path):
    from tests.helpers import run_python

    script_dir = tmp_path / "job"
    script_dir.mkdir()
    (script_dir / "my_storage.py").write_text(
        "from flashckpt_integrations.core.storage import LocalStorage\n"
        "def make(url, **options):\n    return LocalStorage(url)\n"
    )
    (script_dir / "train.py").write_text(
        "import sys, torch\nfrom flashckpt_integrations import Checkpointer\n"
        "with Checkpointer(sys.argv[1], storage_factory='my_storage:make') as ck:\n"
        "    r = ck.save(3, {'w': torch.ones(4)}).wait(90)\n"
        "    print('committed', r.committed, r.error)\n"
    )
    out = run_python(f"import runpy, sys; sys.path.insert(0, {str(script_dir)!r}); "
                     f"sys.argv = ['train.py', {str(tmp_path / 'ckpt')!r}]; "
                     f"runpy.run_path({str(script_dir / 'train.py')!r}, run_name='__main__')",
                     timeout=120)
    assert "committed True None" in out.stdout, out.stdout + out.stderr
