#!/usr/bin/env bash
# The GPU check, in one command on any CUDA host (run from the repository root): build the kernels with CMake, build
# the torch extension, run the gpu-marked tests (the plugin kernels against their host build, the torch backend's
# drafter on them against the PyTorch reference, drafter training on the GPU against the CPU run), and print the
# kernel micro-benchmark table (attention and selector: µs, achieved bytes/s against a device-to-device copy;
# the decode loop's verification on the GPU against the host).
# Python: $PY, else .venv/bin/python where its torch sees a GPU (`make setup` with a CUDA build of torch), else python3
# where its torch does (with safetensors, numpy, tqdm and pytest; src/ goes on PYTHONPATH); where none does, it says
# so. Where $OUT names a folder, the JSON and the whole log are copied there too. Each stage runs within a time
# limit and whatever failed before it; each test file in a process of its own; a failed extension build prints
# the compiler's output.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
             echo "Usage: scripts/gpu_check.sh (no arguments; environment: PY, OUT, and TensorRT_ROOT: the TensorRT"
             echo "installation the plugin library is built against, passed to CMake; default: CMake's own search)"
             exit 0 ;;
  "") ;;
  *) echo "error: scripts/gpu_check.sh takes no arguments (got $1; see --help)" >&2; exit 2 ;;
esac
if [[ -z "${PY:-}" ]]; then  # a venv copied from a CPU host has torch's CPU wheel: python3 then; where neither sees
  PY=""                      # a GPU, the first with torch, to say so (python3 without torch said it had none)
  for want in cuda torch; do
    for candidate in .venv/bin/python python3; do
      if [[ -z "$PY" ]] && command -v "$candidate" >/dev/null && "$candidate" -c "import sys, torch
sys.exit(0 if '$want' == 'torch' or torch.cuda.is_available() else 1)" 2>/dev/null; then PY=$candidate; fi
    done
  done
  PY=${PY:-python3}
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${OUT:-}" ]]; then  # everything from here on also goes to $OUT/gpu_check.log
  mkdir -p "$OUT"
  exec > >(tee "$OUT/gpu_check.log") 2>&1
  tee_pid=$!
  trap 'exec >&- 2>&-; wait "$tee_pid" || true' EXIT  # the log's last lines are written before this exits
fi
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true; fi
# one line and exit status 2 where this cannot run: no torch for $PY, or no CUDA device it can see
why=$("$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
  torch.version.cuda)" 2>&1) || { echo "error: $PY has no torch ($(tail -n 1 <<<"$why")): set PY to a python with" \
  "a CUDA build of torch" >&2; exit 2; }
echo "$why"
why=$("$PY" -c "import torch; raise SystemExit(0 if torch.cuda.is_available() else 1)" 2>&1) \
  || { echo "error: $PY's torch sees no CUDA device${why:+ ($(tail -n 1 <<<"$why"))}: this check needs a GPU host" >&2
       exit 2; }
SECONDS=0
status=0  # a failed stage does not stop the later ones: one run shows every result; the exit status is the last failure
# each stage within a time limit (a kernel that hangs would have held every later stage until the caller's own limit)
stage() { local limit=$1 name=$2; shift 2; echo "== $name (${SECONDS} s)"
          timeout -k 10 "$limit" "$@" || { status=$?; echo "== FAILED with exit status ${status}$([[ $status == 124 ]] \
            && echo " (over its ${limit} s)"): $*"; }; }
cmake_args=(-S plugins -B plugins/_build ${TensorRT_ROOT:+-DTensorRT_ROOT=$TensorRT_ROOT})
stage 60 "CMake configure and the host kernels (the tests' reference)" bash -c \
  "cmake ${cmake_args[*]} && cmake --build plugins/_build -j $(nproc) --target beamtrt_kernels_host"
stage 120 "CMake build of the rest of plugins/" cmake --build plugins/_build -j "$(nproc)"
stage 180 "torch extension" "$PY" -c "from beamtrt.native import cuda; cuda.extension(); print('extension: built')"
log=$("$PY" -c "from beamtrt.native import cuda; print(cuda.build_log())" || true)  # a failed build's compiler output
if [[ -f "$log" ]]; then echo "== the extension's build log, last 80 lines ($log)"; tail -n 80 "$log"; fi
for file in tests/test_plugins.py tests/test_drafter_kernels.py tests/test_train_drafter.py; do  # a process each: a
  stage 120 "gpu tests: $file" env CUDA_LAUNCH_BLOCKING=1 BEAMTRT_PLUGINS_BUILD="$PWD/plugins/_build" \
    "$PY" -m pytest -v -p no:cacheprovider -m gpu -rs --durations=5 "$file"  # CUDA fault would spoil every later test
done
mkdir -p bench
rm -f bench/kernels.json  # a failed benchmark leaves no earlier run's table to be copied as this one's
stage 90 "kernel micro-benchmark" "$PY" scripts/bench_kernels.py --json bench/kernels.json
if [[ -n "${OUT:-}" && -f bench/kernels.json ]]; then cp bench/kernels.json "$OUT/"; fi
echo "gpu check done in ${SECONDS} s (exit status ${status})"
exit "$status"
