#!/usr/bin/env bash
# Builds .venv-dlrover: DLRover 0.6.1 (its Flash Checkpoint) next to the same torch as ours, for
# benchmarks/bench_vs_dlrover.py. A virtualenv of its own, so that nothing DLRover pulls in can
# change the project's .venv. torch is installed first and pinned on every install; the script
# fails if pip changed it anyway.
#   scripts/dlrover-venv.sh            # build (or complete) it
#   FLASHCKPT_DLROVER_VENV=DIR ...     # somewhere else
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${FLASHCKPT_DLROVER_VENV:-.venv-dlrover}
TORCH=torch==2.13.0
DLROVER=dlrover==0.6.1

if [[ ! -x "$VENV/bin/python" ]]; then
    PY=python3.11
    if ! command -v "$PY" >/dev/null 2>&1; then
        echo "ERROR: $PY is needed (the project's Python); none was found" >&2
        exit 1
    fi
    echo ">>> creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV"
fi

"$VENV/bin/python" -m pip install -q "$TORCH"                    # first, so nothing resolves another build
"$VENV/bin/python" -m pip install -q "$TORCH" "$DLROVER" grpcio  # DLRover's agent imports grpc

installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
if [[ "$installed" != "${TORCH#torch==}" ]]; then
    echo "ERROR: pip left torch $installed in $VENV, not ${TORCH#torch==}" >&2
    exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer  # noqa: F401

print(f">>> dlrover {md.version('dlrover')}, torch {md.version('torch')}, grpcio {md.version('grpcio')}")
EOF
