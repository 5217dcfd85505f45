#!/usr/bin/env bash
# The GPU check, in one command on any CUDA host (run from the repository root, after `make setup` with a CUDA build
# of torch): build the kernels with CMake, build the torch extension, run the gpu-marked tests (the plugin kernels,
# and drafter training on the GPU against the CPU run), and print the kernel micro-benchmark table (attention bytes/s
# against a device-to-device copy; selector µs per step).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cmake -S plugins -B plugins/_build ${TensorRT_ROOT:+-DTensorRT_ROOT=$TensorRT_ROOT}
cmake --build plugins/_build -j "$(nproc)"
"$PY" -c "from beamtrt.native import cuda; cuda.extension(); print('torch extension: built')"
"$PY" -m pytest -q -m gpu tests/test_plugins.py tests/test_train_drafter.py
mkdir -p bench
"$PY" scripts/bench_kernels.py --json bench/kernels.json
