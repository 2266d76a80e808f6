"""DeepSpeed's CPU shared-memory all-reduce leaves ``/dev/shm/deepspeed_allreduce_buffer_*``
behind (about 66 MiB per rank) when its processes end; each test removes the ones its job made."""

import contextlib
import glob
import os

import pytest


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    pattern = "/dev/shm/deepspeed_allreduce_buffer_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)
