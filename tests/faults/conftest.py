import os
import subprocess

import pytest


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(name, size, mode)``: a fresh tmpfs of ``size`` at ``tmp_path/name``, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); run the suite as root to cover this")
    mounted = []

    def mount(name: str, size: str, mode: str = "0700"):
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def run_base():
    """A short directory for the savers' run directories (a socket path must fit in 108 bytes)."""
    import shutil

    from tests.faults.harness import short_dir

    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)
