#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the GPU tests, then bench_cuda with a step longer and
# a step shorter than the copy. Logs go to OUT_DIR (default ./gpu-checks).
#
#     bash scripts/gpu-checks.sh [OUT_DIR]
#
# Runs from a checkout with torch (CUDA) installed; the package itself need not be installed (the
# checkout is put on PYTHONPATH). crc32c and zlib-ng are optional there: without them the checksums
# fall back to zlib (slower, same results).
set -u
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
    | tee "$out/device.txt"
timeout 300 python3 -m pytest -p no:cacheprovider tests/gpu -v -o addopts="" -rs --timeout 150 \
    > "$out/gpu-tests.log" 2>&1
echo "tests/gpu: exit $?"
grep -E "passed|failed" "$out/gpu-tests.log" | tail -1
timeout 240 python3 benchmarks/bench_cuda.py --gib 4 --repeats 5 2>&1 | tee "$out/bench-cuda.log"
timeout 120 python3 benchmarks/bench_cuda.py --gib 4 --repeats 3 --tokens 4096 2>&1 | tee "$out/bench-cuda-4096.log"
