#!/bin/bash
# PBS Pro: qsub run/pbs.example.sh           (then qsub again to continue the same run after a stop)
# `python -m mpiddp launch` reads the hosts from $PBS_NODEFILE (one line per slot), runs the MPI's own launcher
# on them, and after a failure relaunches without the failed host, resuming from the newest snapshot.
# Hosts beyond what NP needs are spares: here one chunk of three is kept spare by default (HOST_STRIKES=2 retries
# a failed host once before leaving it out, for a job with no spare).
# On qdel (SIGTERM) launch hands SIGUSR1 to the ranks: every rank saves after the same step, the job exits 3.
#PBS -N mpiddp
#PBS -l select=3:ncpus=8:mpiprocs=8
#PBS -l walltime=04:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
slots=$(wc -l < "${PBS_NODEFILE:?not inside a PBS job}")
hosts=$(sort -u "$PBS_NODEFILE" | wc -l)
np="${NP:-$(( slots - slots / hosts ))}"          # all hosts but one; NP=... to choose
run_dir="runs/${RUN_NAME:-${PBS_JOBNAME:-mpiddp}}"
command=(python -m mpiddp launch -np "$np" --max-restarts "${MAX_RESTARTS:-3}" --host-strikes "${HOST_STRIKES:-1}" --run-dir "$run_dir" -- --run-dir "$run_dir" --resume "$@")
echo "+ ${command[*]}" >&2
exec "${command[@]}"
