#!/usr/bin/env bash
# The GPU kit: proves mpiddp's GPU path on a GPU machine in one command, well inside 8 minutes, with no network.
#   bash run/gpu/prove.sh [OUT_DIR [--only PART ...] [--wheels DIR] [--budget SECONDS]]
# OUT_DIR: the argument, else $OUT, else run/bench/results/gpu-<UTC time>. It gets gpu-kit.json (every result),
# tier.log (pytest -m gpu) and parts.log (every other command and its output). Bring the MPI wheels first on a
# machine with no MPI (bash run/gpu/fetch-wheels.sh, then carry run/gpu/wheels/). Without a GPU it completes in
# seconds, every GPU part skipped with its reason. Exit status 1 when a part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-run/bench/results/gpu-$(date -u +%Y%m%d-%H%M%S)}}
python=${PYTHON:-python3}
echo "+ $python run/gpu/prove.py $out"
exec "$python" run/gpu/prove.py "$out" "${@:2}"
