#!/bin/bash
# One call on a GPU machine (each start of one costs minutes): the CUDA kernels built once,
# the GPU test suite, then benchmarks/kernels.py with the arguments given, if any.
#
#   bash benchmarks/gpu_check.sh [kernels.py arguments, e.g. --only ceilings,prefill,indexer]
#
# TESTS (default tests/gpu) narrows the suite; TEST_TIMEOUT / BENCH_TIMEOUT (seconds, 270
# each: with the build they fit one 10-minute call) bound each step, so that a hang in one
# still leaves the other's output.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
timeout -k 10 300 python -c \
    "from dsaserve.kernels.cuda import build; print('CUDA kernels:', build.build() or 'built')"
timeout -k 10 "${TEST_TIMEOUT:-270}" python -m pytest -q -m gpu ${TESTS:-tests/gpu} \
    -rf --tb=short 2>&1 | grep -v "^E  *+" | tail -40
if [ $# -gt 0 ]; then
    timeout -k 10 "${BENCH_TIMEOUT:-270}" python benchmarks/kernels.py "$@" 2>&1 | tail -80
fi
