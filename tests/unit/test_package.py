"""Import hygiene and the public surface."""

import subprocess
import sys

import flashckpt_integrations as fc


def test_import_needs_torch_only():
    code = (
        "import sys\n"
        "for name in ('transformers', 'accelerate', 'deepspeed', 'megatron', 'safetensors', 'fsspec', 's3fs'):\n"
        "    sys.modules[name] = None\n"
        "import flashckpt_integrations, flashckpt_integrations.core.engine, flashckpt_integrations.core.saver\n"
        "import flashckpt_integrations.cli\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_reexports_are_the_implementation_objects():
    from flashckpt_integrations.config import CheckpointerConfig
    from flashckpt_integrations.core.engine import Checkpointer, SaveStatus
    from flashckpt_integrations.core.retention import RetentionPolicy
    from flashckpt_integrations.errors import FlashCkptError

    assert fc.Checkpointer is Checkpointer and fc.SaveStatus is SaveStatus
    assert fc.CheckpointerConfig is CheckpointerConfig and fc.RetentionPolicy is RetentionPolicy
    assert fc.FlashCkptError is FlashCkptError
    assert set(fc.__all__) == {n for n in fc.__all__ if hasattr(fc, n)}


def test_missing_fsspec_says_what_to_install():
    code = (
        "import sys\nsys.modules['fsspec'] = None\n"
        "from flashckpt_integrations.core.storage import storage_from_url\n"
        "try:\n    storage_from_url('s3://bucket/x')\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'flashckpt-integrations[s3]'" in done.stdout, done.stderr


def test_config_validation_says_how_to_fix():
    import pytest

    with pytest.raises(ValueError, match="commit_timeout_s"):
        fc.CheckpointerConfig(commit_timeout_s=0)
    with pytest.raises(ValueError, match="step"):
        fc.Layout(step_dir="checkpoints")
