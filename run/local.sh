#!/usr/bin/env bash
# Train on this machine with N ranks (default 2): run/local.sh [N] [mpiddp flags...]
# Prints the exact command before running it.
set -euo pipefail
ranks="${1:-2}"
[ $# -gt 0 ] && shift
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
mpirun="$(dirname "$python")/mpirun"
[ -x "$mpirun" ] || mpirun="$(command -v mpirun)"
extra=()
if "$mpirun" --version 2>/dev/null | grep -q "Open MPI"; then
  # more ranks than cores is fine for CPU training; root needs Open MPI's explicit consent
  extra+=(--oversubscribe)
  if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
fi
command=("$mpirun" -np "$ranks" "${extra[@]}" "$python" -m mpiddp "$@")
echo "+ ${command[*]}" >&2
cd "$here"
exec "${command[@]}"
