import os
import shutil
import uuid

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def private_shm_dir(monkeypatch):
    """Each test gets its own shared-memory directory, inherited by the processes it starts,
    so that tests (and anything else on the host) never see or remove each other's slots."""
    path = f"/dev/shm/flashckpt-test-{uuid.uuid4().hex[:12]}"
    os.mkdir(path, 0o700)
    monkeypatch.setenv("FLASHCKPT_SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_checkpointer(tmp_path):
    """Build checkpointers that are closed at teardown."""
    from flashckpt_integrations import Checkpointer

    made = []

    def make(directory=None, **kwargs):
        ck = Checkpointer(directory or tmp_path / "ckpt", **kwargs)
        made.append(ck)
        return ck

    yield make
    for ck in made:
        ck.close()
