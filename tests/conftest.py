import os
import shutil
import uuid
import zipfile

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


TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")


@pytest.fixture(autouse=True)
def every_torch_file_is_a_valid_zip(request):
    """After each test, every torch zip file left under its temporary directory passes zipfile's
    CRC check (archive checkers and uploaders reject a file that does not)."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    root = str(request.getfixturevalue("tmp_path"))  # set up before this fixture: torn down after it
    yield
    bad = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not name.endswith(TORCH_ZIP_SUFFIXES) or not zipfile.is_zipfile(path):
                continue
            try:
                with zipfile.ZipFile(path) as archive:
                    broken = archive.testzip()
            except (zipfile.BadZipFile, OSError) as exc:
                broken = str(exc)
            if broken is not None:
                bad.append(f"{os.path.relpath(path, root)}: {broken}")
    assert not bad, f"torch files that are not valid zips: {bad}"


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
