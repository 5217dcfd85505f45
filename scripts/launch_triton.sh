#!/usr/bin/env bash
# Launch an exported Triton model repository in leader mode: mpirun starts one tritonserver per rank; rank 0 loads
# every model and serves requests, ranks > 0 load only beam_dflash2, whose stub joins MPI and steps with rank 0.
# Usage: scripts/launch_triton.sh --world-size N --model-repo REPO [options]   (--help for all of them)
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/launch_triton.sh --world-size N --model-repo REPO [--tritonserver PATH] [--mpirun PATH]
                                [--http-port P] [--grpc-port P] [--metrics-port P] [--log-file FILE] [--dry-run]

Start N tritonserver processes under mpirun (leader mode) on a repository written by scripts/export_triton.py.
N must be the world size the repository was exported with (the build's TP).

  --world-size N      ranks = Triton processes (required)
  --model-repo REPO   the model repository (required)
  --tritonserver PATH the tritonserver binary (default: tritonserver on PATH, else /opt/tritonserver/bin/tritonserver)
  --mpirun PATH       the mpirun binary (default: the project's .venv/bin/mpirun, as make setup installs it, else
                      mpirun on PATH; scripts/mpirun picks it the same way)
  --http-port P       rank 0's HTTP port (default 8000); rank r > 0 uses P + 10 r
  --grpc-port P       rank 0's gRPC port, the one clients use (default 8001); rank r > 0 uses P + 10 r
  --metrics-port P    rank 0's metrics port (default 8002); rank r > 0 uses P + 10 r
  --log-file FILE     rank 0's verbose Triton log (default: none)
  --dry-run           print the mpirun command (with the environment it sets) instead of running it
  -h, --help          this help

Open MPI as root and with more ranks than cores needs OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
and PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe; each is set here when unset.
EOF
}

fail() { echo "error: $*" >&2; exit 2; }

world="" repo="" tritonserver="" mpirun="" http=8000 grpc=8001 metrics=8002 log="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --flag=value, as the Python commands take it
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1; shift; continue ;;
    --world-size|--model-repo|--tritonserver|--mpirun|--http-port|--grpc-port|--metrics-port|--log-file)
      [ $# -ge 2 ] || fail "$1 needs a value"
      [ -n "$2" ] || fail "$1: an empty value (an unset shell variable?)"
      case "$1" in
        --world-size) world=$2 ;; --model-repo) repo=$2 ;; --tritonserver) tritonserver=$2 ;; --mpirun) mpirun=$2 ;;
        --http-port) http=$2 ;; --grpc-port) grpc=$2 ;; --metrics-port) metrics=$2 ;; --log-file) log=$2 ;;
      esac
      shift 2 ;;
    *) fail "unknown argument $1 (see --help)" ;;
  esac
done

[ -n "$world" ] || fail "--world-size is required (the build's TP; see --help)"
[ -n "$repo" ] || fail "--model-repo is required (a repository written by scripts/export_triton.py)"
[[ "$world" =~ ^[1-9][0-9]{0,3}$ ]] || fail "--world-size must be an integer in [1, 9999], got '$world'"
for port in "$http" "$grpc" "$metrics"; do
  [[ "$port" =~ ^[1-9][0-9]{0,4}$ ]] || fail "ports must be positive integers, got '$port'"
done
top=$((10 * (world - 1)))  # rank r uses port + 10 r: every port of every rank must be valid and distinct
for port in "$http" "$grpc" "$metrics"; do
  [ $((port + top)) -le 65535 ] || fail "port $port + 10 x $((world - 1)) ranks is beyond 65535"
done
used=" "
for ((offset = 0; offset <= top; offset += 10)); do
  for port in $((http + offset)) $((grpc + offset)) $((metrics + offset)); do
    [[ "$used" == *" $port "* ]] && fail "port $port is given to two servers (--http-port, --grpc-port and \
--metrics-port must differ, and rank r adds 10 r to each)"
    used+="$port "
  done
done
if [ -n "$log" ]; then
  [ -d "$log" ] && fail "--log-file $log is a directory"
  [ -d "$(dirname -- "$log")" ] || fail "--log-file $log: no folder $(dirname -- "$log")"
fi
[ -f "$repo/beam_dflash2/config.pbtxt" ] ||
  fail "$repo is not an exported model repository (no beam_dflash2/config.pbtxt)"
repo="$(cd -- "$repo" && pwd)"  # absolute: what every rank is given, and no path below starts with a dash
config="$repo/beam_dflash2/config.pbtxt"
# the world_size parameter: the line after key: "world_size" holds its string_value
exported="$(grep -A 2 'key: "world_size"' "$config" | sed -n 's/.*string_value: "\([0-9]*\)".*/\1/p' || true)"
[ "$exported" = "$world" ] || fail "$repo was exported for world size ${exported:-?} (the build's TP), not $world"

if [ -z "$tritonserver" ]; then
  tritonserver="$(command -v tritonserver || echo /opt/tritonserver/bin/tritonserver)"
fi
if [ -z "$mpirun" ]; then
  mpirun="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/mpirun"
  [ -x "$mpirun" ] || mpirun="$(command -v mpirun || true)"
fi
if [ "$dry" = 0 ]; then
  [ -x "$tritonserver" ] || fail "tritonserver not found at $tritonserver (pass --tritonserver PATH)"
  [ -n "$mpirun" ] && [ -x "$mpirun" ] || fail "mpirun not found (install Open MPI, or pass --mpirun PATH)"
fi

export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT:-1}"
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
export PRTE_MCA_rmaps_default_mapping_policy="${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}"

cmd=("${mpirun:-mpirun}")
for ((rank = 0; rank < world; rank++)); do
  [ "$rank" -gt 0 ] && cmd+=(":")
  offset=$((10 * rank))
  cmd+=(-n 1 "$tritonserver" "--model-repository=$repo" "--disable-auto-complete-config"
        "--backend-config=python,shm-region-prefix-name=prefix${rank}_"
        "--http-port=$((http + offset))" "--grpc-port=$((grpc + offset))" "--metrics-port=$((metrics + offset))")
  if [ "$rank" -gt 0 ]; then
    cmd+=("--model-control-mode=explicit" "--load-model=beam_dflash2")
  elif [ -n "$log" ]; then
    cmd+=("--log-verbose=1" "--log-file=$log")
  fi
done

if [ "$dry" = 1 ]; then  # a command to paste: with the environment Open MPI needs here
  for name in OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM PRTE_MCA_rmaps_default_mapping_policy; do
    printf '%s=%q ' "$name" "${!name}"
  done
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
echo "launching $world rank(s); clients use gRPC port $grpc (rank 0)" >&2
exec "${cmd[@]}"
