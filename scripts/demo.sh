#!/usr/bin/env bash
# Install (torch first!) and run the DDP checkpointing demo on CPU.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=python
command -v "$PY" >/dev/null 2>&1 || PY=python3

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export PYTHONUNBUFFERED=1

"$PY" -m pip install torch==2.13.0
"$PY" -m pip install -e .

exec "$PY" examples/ddp/demo.py "$@"
