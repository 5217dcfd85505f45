#!/usr/bin/env bash
# The engine check, in one command on a TensorRT-LLM 1.2 GPU host (run from the repository root after `make setup`
# with a python3 that has tensorrt_llm 1.2.x and a CUDA build of torch: .venv then sees them):
#   for each precision (bf16, fp8, and nvfp4 on Blackwell): build beam-mini's engines, decode the same prompts with
#   the trt and the torch backends, and print greedy token identity, acceptance length and tokens/s for both.
# Usage: scripts/gpu_host_check.sh [--tp N] [--precisions "bf16 fp8 nvfp4"] [--max-new-tokens N]
#   --tp: ranks, one GPU each (default 1); --precisions: any of bf16, fp8, nvfp4, space-separated (default: bf16 fp8,
#   and nvfp4 on Blackwell); --max-new-tokens: per prompt (default 64). Python: $PY (default .venv/bin/python).
# Reports go to bench/gpu-host/<precision>-tp<N>/ (run JSONs, comparison JSON, build log). Greedy identity between
# the backends is reported, not required: TensorRT's and PyTorch's GEMMs may round a near-tie differently.
set -euo pipefail
set -f  # --precisions is split into words, never expanded as file names
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TP=1
PRECISIONS=""
MAX_NEW=64
fail() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tp|--precisions|--max-new-tokens) [ $# -ge 2 ] || fail "$1 needs a value (see --help)"
      [ -n "$2" ] || fail "$1: an empty value (an unset shell variable?)" ;;
  esac
  case "$1" in
    --tp) TP="$2"; shift 2 ;;
    --precisions) PRECISIONS="$2"; shift 2 ;;
    --max-new-tokens) MAX_NEW="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) fail "unknown argument $1 (see --help)" ;;
  esac
done
[[ "$TP" =~ ^[1-9][0-9]*$ ]] || fail "--tp must be a positive integer, got $TP"
[[ "$MAX_NEW" =~ ^[1-9][0-9]*$ ]] || fail "--max-new-tokens must be a positive integer, got $MAX_NEW"
if [ -n "$PRECISIONS" ]; then  # all checked before the first build
  words=($PRECISIONS)  # split on any whitespace (globbing is off), as the build loop below takes them
  [ "${#words[@]}" -gt 0 ] || fail "--precisions: no precision given (bf16, fp8, nvfp4, separated by spaces)"
  for precision in "${words[@]}"; do
    case "$precision" in bf16|fp8|nvfp4) ;; *) fail "--precisions: unknown precision '$precision' (bf16, fp8, nvfp4, \
separated by spaces)" ;; esac
  done
fi
command -v "$PY" >/dev/null || fail "$PY not found: run make setup in a Python with tensorrt_llm 1.2, or set PY"

"$PY" - <<'EOF' || exit 2
import sys
from beamtrt.build.engine import engine_support
why = engine_support()
if why:
    print(f"error: {why}; this check needs TensorRT-LLM 1.2 and a GPU", file=sys.stderr)
    sys.exit(2)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
[ "$TP" -le "$GPUS" ] || fail "--tp $TP needs $TP GPUs; this host has $GPUS"
if [ -z "$PRECISIONS" ]; then
  PRECISIONS="bf16 fp8"
  "$PY" -c "import torch, sys; sys.exit(torch.cuda.get_device_capability()[0] < 10)" && PRECISIONS="$PRECISIONS nvfp4"
fi
launch() { if [ "$TP" -gt 1 ]; then scripts/mpirun -n "$TP" "$@"; else "$@"; fi; }

PROMPTS=src/beamtrt/data/calib_prompts.jsonl  # general prompts, not a benchmark set
for precision in $PRECISIONS; do
  out="engines/check-$precision-tp$TP"
  report="bench/gpu-host/$precision-tp$TP"
  mkdir -p "$report"
  echo "== $precision, tp $TP: building $out"
  if ! "$PY" build/build_engines.py --precision "$precision" --tp "$TP" --out "$out" --force --quiet \
      > "$report/build.log" 2>&1; then
    cat "$report/build.log" >&2  # ends with the build's error: line
    exit 2
  fi
  cat "$report/build.log"
  "$PY" -c "import json, sys; s = json.load(open('$out/manifest.json'))['stages']['engines']; \
s['status'] in ('ran', 'reused') or sys.exit(f\"error: engines {s['status']}: {s.get('reason')}\")" || exit 2
  run=(runtime/run.py --engine-dir "$out" --dtype bfloat16 --prompts "$PROMPTS" --max-new-tokens "$MAX_NEW"
       --concurrency 8 --quiet)
  echo "== $precision, tp $TP: decoding with the trt backend ($TP rank(s))"
  launch "$PY" "${run[@]}" --backend trt --json "$report/run-trt.json"
  echo "== $precision: decoding with the torch backend (one process on cuda:0, the checkpoints un-sharded)"
  "$PY" "${run[@]}" --backend torch --device cuda --json "$report/run-torch.json"
  "$PY" -m beamtrt.bench.backends "torch=$report/run-torch.json" "trt=$report/run-trt.json" \
    --title "beam-mini $precision, tp $TP" --json "$report/compare.json"
done
