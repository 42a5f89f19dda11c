#!/usr/bin/env bash
# Train on several hosts from this one (the master node):
#   run/multinode.sh HOSTFILE_OR_HOSTLIST NUM_RANKS [mpiddp flags...]
#   run/multinode.sh hostfiles/openmpi.example 16 --dataset cifar10 --data-dir /data
#   run/multinode.sh nodea:8,nodeb:8 16 --arch resnet50 --use_syn
# Works with Open MPI and MPICH (whichever mpirun sits next to python). Prerequisites: the same venv path on
# every host, passwordless ssh between hosts. Extra launcher options go in MPIRUN_ARGS. Prints the exact command.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
hosts="$1"; ranks="$2"; shift 2
python="${PYTHON:-$(command -v python || command -v python3)}"
mpirun="$(dirname "$python")/mpirun"
[ -x "$mpirun" ] || mpirun="$(command -v mpirun)"

# What the remote ranks need from this shell: the venv on PATH, libraries, and any job settings.
forward=(PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV)
while IFS='=' read -r name _; do
  case "$name" in MPIDDP_*|NCCL_*|GLOO_*|WANDB_*|OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES) forward+=("$name") ;; esac
done < <(env)
present=()
for name in "${forward[@]}"; do [ -n "${!name:-}" ] && present+=("$name"); done

read -r -a extra <<< "${MPIRUN_ARGS:-}"
if "$mpirun" --version 2>/dev/null | grep -q "Open MPI"; then
  if [ -f "$hosts" ]; then placement=(--hostfile "$hosts"); else placement=(-H "$hosts"); fi
  env_args=()
  for name in "${present[@]}"; do env_args+=(-x "$name"); done
  # No core binding: it starves data-loader workers. Fill each host's slots in order.
  command=("$mpirun" -np "$ranks" "${placement[@]}" --bind-to none --map-by slot "${env_args[@]}" "${extra[@]}")
  if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
else
  if [ -f "$hosts" ]; then placement=(-f "$hosts"); else placement=(-hosts "$hosts"); fi
  genvlist=$(IFS=,; echo "${present[*]}")
  command=("$mpirun" -n "$ranks" "${placement[@]}" -bind-to none -genvlist "$genvlist" "${extra[@]}")
fi
command+=("$python" -m mpiddp "$@")
echo "+ ${command[*]}" >&2
exec "${command[@]}"
