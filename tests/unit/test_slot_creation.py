"""A slot that cannot be created leaves no file behind in the shared-memory directory.

The failures are real ones, reachable without privileges: a request larger than the free space of
the directory (what a small /dev/shm answers), ``posix_fallocate`` refused with EFBIG by
``RLIMIT_FSIZE`` (what a file system that refuses the size answers), and ``mmap`` refused with
ENOMEM by ``RLIMIT_AS`` (an error while mapping). The limits are set in a child process only.
"""

import json
import os

import pytest

from flashckpt_integrations.core.shm_buffer import Slot, shm_free_bytes
from flashckpt_integrations.errors import SharedMemoryError
from tests.helpers import run_python


def test_a_slot_larger_than_the_free_shared_memory_leaves_no_file(private_shm_dir):
    path = os.path.join(private_shm_dir, "slot-too-large")
    with pytest.raises(SharedMemoryError, match="not enough shared memory"):
        Slot.create_or_open(path, shm_free_bytes(private_shm_dir) + 2**30)
    assert os.listdir(private_shm_dir) == []


def test_a_failed_creation_keeps_an_existing_slot(private_shm_dir):
    path = os.path.join(private_shm_dir, "slot-existing")
    slot = Slot.create_or_open(path, 4096)
    slot.close()
    with pytest.raises(SharedMemoryError):
        Slot.create_or_open(path, shm_free_bytes(private_shm_dir) + 2**30)
    assert os.path.getsize(path) == slot.size, "a slot that was there before stays, at its size"


_LIMITED = r"""
import json, os, resource, sys
from flashckpt_integrations.core.shm_buffer import Slot
from flashckpt_integrations.errors import SharedMemoryError

shm_dir = sys.argv[1]
out = {}

def attempt(name, limit, value, nbytes):
    soft, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (value, hard))
    try:
        Slot.create_or_open(os.path.join(shm_dir, name), nbytes)
        out[name] = "created"
    except SharedMemoryError as exc:
        out[name] = str(exc)
    finally:
        resource.setrlimit(limit, (soft, hard))

attempt("fsize", resource.RLIMIT_FSIZE, 1 << 20, 16 << 20)       # fallocate: EFBIG (SIGXFSZ is ignored)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
attempt("as", resource.RLIMIT_AS, vm + (8 << 20), 64 << 20)      # mmap: ENOMEM
out["left"] = sorted(os.listdir(shm_dir))
print(json.dumps(out))
"""


def test_a_refused_size_or_mapping_leaves_no_file(private_shm_dir):
    if shm_free_bytes(private_shm_dir) < 128 << 20:
        pytest.skip("needs 128 MiB free in the shared-memory directory")
    done = run_python(_LIMITED, private_shm_dir, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ran out while growing" in out["fsize"] and "File too large" in out["fsize"], out
    assert "cannot map" in out["as"], out
    assert out["left"] == [], "no empty or partial slot file stays behind"


@pytest.mark.parametrize("end", ["close", "remove_all"])
def test_a_receive_abandoned_after_the_job_ended_leaves_nothing_to_load(private_shm_dir, end):
    """A peer's copy still being received when the job ends cleanly: the store unmaps its slots
    under the receive, which then gives up on a slot that is closed (it used to fail there)."""
    from flashckpt_integrations.core.replication import ReplicaStore, list_replicas

    store = ReplicaStore(private_shm_dir, "job")
    slot = store.begin(1, 5, 5, 0, 1 << 16)
    getattr(store, end)()
    store.abandon(slot, 1)
    assert list_replicas(private_shm_dir, "job") == []
