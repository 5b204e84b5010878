#!/bin/bash
# The owed H200 runs of docs/gpu_runs_owed.md in one device call, most valuable first, each
# bounded so that a hang leaves the others' output. Logs and tables go to $OUT (the device
# call's output folder) or ./gpu-out.
#
#   bash benchmarks/gpu_owed.sh            # under 10 minutes on one H200 (each step bounded)
#
# nixl is not installed on the device machine: put the nixl-cu13 1.5.1 wheel in .whl/ (see
# docs/gpu_runs_owed.md) and carry it; without it the NIXL test skips and the P/D run fails.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$site
fi
run() {  # run SECONDS NAME COMMAND...: the command's output into $out/NAME.log, its tail shown
    local limit=$1 name=$2
    shift 2
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
    grep -v "loading shards\|NIXL INFO" "$out/$name.log" | tail -15
}
run 120 build python -c \
    "from dsaserve.kernels.cuda import build; print('CUDA kernels:', build.build() or 'built')"
run 150 tests python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_cudagraph_gpu.py \
    tests/gpu/test_nixl_gpu.py tests/gpu/test_hisparse_fetch_gpu.py \
    tests/gpu/test_hisparse_spill_gpu.py tests/gpu/test_hisparse_residency_gpu.py \
    tests/gpu/test_kernels_gpu.py \
    -k "not test_kernels_gpu or indexer_logits_and_topk"
run 100 decode python benchmarks/decode.py --contexts 8192,131072 --batches 1,64 --steps 10 \
    --out "$out/decode_h200.md"
run 40 hisparse python benchmarks/hisparse.py --out "$out/hisparse_h200.md"
run 50 long_prefill python benchmarks/long_prefill.py --lengths 512K,1M --no-profile
run 50 long_prefill_overlap python benchmarks/long_prefill.py --lengths 512K,1M --no-profile \
    --overlap-topk
run 60 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd_h200.md"
run 50 offload_decode python benchmarks/offload.py --tables decode
