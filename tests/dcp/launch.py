"""Run the DCP test scripts under torchrun and read back what each rank recorded."""

import os
import subprocess
import sys

from tests.distributed.launch import env, free_port, torchrun_cmd

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240, **extra_env: str
             ) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(nproc, free_port()) + [os.path.join(HERE, script), *map(str, args)]
    return subprocess.run(cmd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)


def python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env(), capture_output=True, text=True,
                          timeout=timeout)
