import glob
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _no_leaked_slots():
    """Each test removes the shared memory it leaves behind (crash tests leave it on purpose)."""
    before = set(glob.glob(f"/dev/shm/flashckpt-{os.getuid()}-*"))
    yield
    for path in set(glob.glob(f"/dev/shm/flashckpt-{os.getuid()}-*")) - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


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
