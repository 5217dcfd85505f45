#!/usr/bin/env bash
# The GPU check, in one command on any CUDA host (run from the repository root): build the kernels with CMake, build
# the torch extension, run the gpu-marked tests (the plugin kernels, and drafter training on the GPU against the CPU
# run), and print the kernel micro-benchmark table (attention bytes/s against a device-to-device copy; selector µs per
# step). Python: $PY, else .venv/bin/python (after `make setup` with a CUDA build of torch), else python3 (a host whose
# python3 has torch with CUDA, safetensors, numpy, tqdm and pytest; src/ goes on PYTHONPATH). Where $OUT names a
# folder, the JSON and the whole log are copied there too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${OUT:-}" ]]; then  # everything from here on also goes to $OUT/gpu_check.log
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
SECONDS=0
cmake -S plugins -B plugins/_build ${TensorRT_ROOT:+-DTensorRT_ROOT=$TensorRT_ROOT}
cmake --build plugins/_build -j "$(nproc)"
echo "plugins built in ${SECONDS} s"
"$PY" -c "from beamtrt.native import cuda; cuda.extension(); print('torch extension: built')"
echo "torch extension built by ${SECONDS} s"
status=0  # failed tests do not stop the micro-benchmark: one run shows both
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_plugins.py tests/test_train_drafter.py || status=$?
echo "gpu tests done by ${SECONDS} s (pytest exit status ${status})"
mkdir -p bench
"$PY" scripts/bench_kernels.py --json bench/kernels.json
if [[ -n "${OUT:-}" ]]; then cp bench/kernels.json "$OUT/"; fi
echo "gpu check done in ${SECONDS} s"
exit "$status"
