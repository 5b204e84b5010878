#!/bin/bash
# The owed H200 runs of docs/gpu_runs_owed.md in one device call, most valuable first, each
# bounded so that a hang leaves the others' output. Logs and tables go to $OUT (the device
# call's output folder) or ./gpu-out.
#
#   bash benchmarks/gpu_owed.sh 1          # part 1: GPU tests, NIXL VRAM, copier pieces
#   bash benchmarks/gpu_owed.sh 2          # part 2: HiSparse, P/D, decode with async scheduling
#   bash benchmarks/gpu_owed.sh 3          # part 3: a prefill step's host time at 2, 4, 8 layers
#   bash benchmarks/gpu_owed.sh 4          # part 4: long prefill, synchronised against async;
#                                          #   the 1M prompt twice more (does its token repeat?)
#   bash benchmarks/gpu_owed.sh 5          # part 5: part 1's failures again (fixed or isolated),
#                                          #   then part 2's HiSparse, P/D and async decode rows
#   bash benchmarks/gpu_owed.sh 6          # part 6: part 5's unfinished tests, the prefill host
#                                          #   term at 4K over 2, 4, 6 layers, P/D end to end
#   bash benchmarks/gpu_owed.sh 7          # part 7: the top-k in a fixed order (run to run, its
#                                          #   cost), the fp8 engines against each other again,
#                                          #   the staged P/D READ, the batched sampler, HiSparse's
#                                          #   fused fetch; decode and HiSparse timed again
#   bash benchmarks/gpu_owed.sh 8          # part 8: the top-k in key order (its cost), engines
#                                          #   repeating themselves, decode with its host profile,
#                                          #   long prefill at 4K and 128K
#   bash benchmarks/gpu_owed.sh 9          # part 9: the sampler and graph tests part 7 did not
#                                          #   reach, the fp8 spill tests up to near-ties; the
#                                          #   decode table for plan/hosttime.py's refit
#                                          #   (8K and 128K, b = 1 and 64)
#   bash benchmarks/gpu_owed.sh 10         # part 10: HiSparse's engine-level targets (step
#                                          #   against all-GPU with a model's own misses,
#                                          #   concurrency at a fixed budget), P/D end to end
#   bash benchmarks/gpu_owed.sh 11         # part 11: FP8 weights kept in FP8: the kernels'
#                                          #   tests and timings, the engine's tests, decode
#                                          #   with FP8 against bf16 weights (same call); the
#                                          #   step log's GPU times
#   bash benchmarks/gpu_owed.sh 12         # part 12: part 11's step log and part 9's HiSparse
#                                          #   spill tests again (fixed), the FP8 tests and
#                                          #   GEMMs with prefill dequantized, then HiSparse's
#                                          #   engine-level targets and, in the time left,
#                                          #   its 1M-token request
#   bash benchmarks/gpu_owed.sh 13         # part 13: decode at 16 layers (MTP3's speed-up),
#                                          #   the FP8 64-row bucket's sweep, P/D end to end
#   bash benchmarks/gpu_owed.sh 14         # part 14: the MoE combine and routing kernels,
#                                          #   the FP8 split rule (tests, timings), the MTP
#                                          #   rows' grid (no faster: its section deleted), P/D's READ
#                                          #   step split, MTP3 at 16 layers again, HiSparse's
#                                          #   step at 8K with its misses
#   bash benchmarks/gpu_owed.sh 15         # part 15: part 14's two failures again (fixed),
#                                          #   P/D's posting profiled, HiSparse's 1M request
#   bash benchmarks/gpu_owed.sh 16         # part 16: P/D's posting on half the cores, long
#                                          #   prefill synchronised against async
#   bash benchmarks/gpu_owed.sh 17         # part 17: HiSparse's parting tokens at near-ties?,
#                                          #   the 4K prefill's host time, MTP3 with FP8
#   bash benchmarks/gpu_owed.sh 18         # part 18: HiSparse = all-GPU on equal batches, P/D
#                                          #   into the host pool, P/D's posting at 32K/128K,
#                                          #   1M through P/D below one window, the step rows
#   bash benchmarks/gpu_owed.sh 19         # part 19: the step rows on equal batches again
#                                          #   (hot rows read in the page path's own calls),
#                                          #   the 1M request through P/D (its claim by digest)
#   bash benchmarks/gpu_owed.sh 20         # part 20: the 1M request's READ into the host
#                                          #   pool, profiled (15.5 s in part 19)
#   bash benchmarks/gpu_owed.sh 21         # part 21: the 1M request aggregated and through
#                                          #   P/D, warm: the same tokens?
#   bash benchmarks/gpu_owed.sh 22         # part 22: the fp8 spilling tests on equal batches
#                                          #   (P/D: one prompt at a time); the 1M request
#                                          #   through P/D, the prefill engine in its own process
#   bash benchmarks/gpu_owed.sh 23         # part 23: the simulator's parts and decode host rows
#                                          #   measured on this GPU (kernels.py --parts,
#                                          #   decode.py --rows-json), for part 24
#   bash benchmarks/gpu_owed.sh 24         # part 24: the calibration with part 23's files
#                                          #   (docs/parts_*.json, docs/decode_rows_*.json)
#   bash benchmarks/gpu_owed.sh 25         # part 25: P/D READs in flight beside running
#                                          #   requests (pd_overlap.py, the prefill engine in
#                                          #   its own process), into pages and the host pool
#   bash benchmarks/gpu_owed.sh 26         # part 26: the calibration on one machine's own host
#                                          #   fits (decode rows at the calibration's batches
#                                          #   and prefill host rows measured first, same call)
#   bash benchmarks/gpu_owed.sh 27         # part 27: decode graphs captured at start-up (the
#                                          #   graph tests), then the calibration with its
#                                          #   in-process probe (plain and MTP3)
#   bash benchmarks/gpu_owed.sh 28         # part 28: a READ into pages with the engine's
#                                          #   stream synchronised, twice in the same
#                                          #   processes; the calibration with its probe at
#                                          #   8K and 32K, plain and MTP3
#   bash benchmarks/gpu_owed.sh 29         # part 29: the calibration of a HiSparse engine
#                                          #   (its pages spilled, misses read from the host
#                                          #   pool), 8K and 32K
#   bash benchmarks/gpu_owed.sh 30         # part 30: part 28's READs into pages with their
#                                          #   posting steps profiled; the calibration with the
#                                          #   MTP layer over every row, eager issue hidden under
#                                          #   long kernels and the prefill probe at 1K–8K; then
#                                          #   part 29
#   bash benchmarks/gpu_owed.sh 31         # part 31: the 4K prefill step's host share before
#                                          #   and after the host-prep cuts, same call
#   bash benchmarks/gpu_owed.sh 32         # part 32: the calibration with its prefill probe
#                                          #   fresh and at depth, then part 31
#   bash benchmarks/gpu_owed.sh 33         # part 33: P/D's posting step profiled with the
#                                          #   prompt hashed at arrival; the calibration with
#                                          #   its probe's rows at 32 steps
#   bash benchmarks/gpu_owed.sh 34         # part 34: the simulator's files of this GPU (an
#                                          #   H200 at last): parts, decode host rows at the
#                                          #   calibration's batches, prefill host rows
#   bash benchmarks/gpu_owed.sh 35         # part 35: the parts of part 34 (its kernels.py
#                                          #   stopped at a variant l2_hint refused), then the
#                                          #   calibration with this GPU's files
#   bash benchmarks/gpu_owed.sh 36         # part 36: the 4K prefill step's idle gaps by host
#                                          #   function (async), then P/D on this GPU: a bare
#                                          #   NIXL READ/WRITE and end to end, 32K and 128K
#   bash benchmarks/gpu_owed.sh 37         # part 37: the calibration of a HiSparse engine
#                                          #   priced at the overlap its runner measured
#   bash benchmarks/gpu_owed.sh 39         # part 39: the experts' grouped GEMM at decode
#                                          #   sizes (Triton against torch._grouped_mm), MTP3
#                                          #   at 16 layers with it
#   bash benchmarks/gpu_owed.sh 44         # part 44: the FP8 grouped kernel at 16 and 64 rows
#                                          #   per expert, FP8 weights at 16 layers, b = 1, 64,
#                                          #   bf16 b = 64 with its verify on the Triton kernel
#   bash benchmarks/gpu_owed.sh 45         # part 45: W8A8 from 65 to 256 rows (tests, its
#                                          #   tiles at 256 rows from graphs)
#   bash benchmarks/gpu_owed.sh 46         # part 46: W8A8 FP8 experts at verify sizes (tests,
#                                          #   grouped GEMMs, FP8 MTP3 at b = 64)
#   bash benchmarks/gpu_owed.sh 47         # part 47: the FP8 GPU tests again, FP8 MTP3's
#                                          #   kernels by category at b = 1 and 64
#   bash benchmarks/gpu_owed.sh 49         # part 49: the cuts after part 47 (fused
#                                          #   projections, cuBLAS block-scaled, ...): GPU
#                                          #   tests, FP8 at 16 layers after and before
#   bash benchmarks/gpu_owed.sh 50         # part 50: parts 49 and the key order in one
#                                          #   call: the key order's kernels, the GPU tests,
#                                          #   FP8 MTP3 at 16 layers after (profiled), before
#   bash benchmarks/gpu_owed.sh 51         # part 51: W8A8 through cuBLAS for FP8 prefill:
#                                          #   the GPU tests, the GEMMs at prefill rows, FP8
#                                          #   prefill before and after
#   bash benchmarks/gpu_owed.sh 52         # part 52: the experts' W8A8 grouped tiles swept
#                                          #   at MTP3's b = 16 and 64 (128, 512 pairs)
#   bash benchmarks/gpu_owed.sh 53         # part 53: part 50's failing GPU test alone, then
#                                          #   FP8 b = 64 at 16 layers with the rank count gone
#   bash benchmarks/gpu_owed.sh 54         # part 54: the drafts' FP8 lm_head at GLM-5.3's
#                                          #   vocabulary: its GPU tests, then MTP3 at 16
#                                          #   layers, b = 1 and 64, drafts through the FP8
#                                          #   copy, the copy's 32,768 first ids (a draft
#                                          #   vocabulary) and lm_head
#   bash benchmarks/gpu_owed.sh 58         # part 58: part 54 cut short: its tests, b = 1
#                                          #   only, the FP8 head whole and over 32,768 ids
#   bash benchmarks/gpu_owed.sh 55         # part 55: the grouped GEMM's K split at decode:
#                                          #   its GPU tests, the splits swept at 2, 8 and 128
#                                          #   pairs, FP8 16 layers b = 1 and 64 after and
#                                          #   before (out/old: the tree at a2ef128, carried)
#   bash benchmarks/gpu_owed.sh 56         # part 56: the weight-only FP8 kernel's tiles and
#                                          #   K splits swept at one row (b = 1), o_proj and q_b
#   bash benchmarks/gpu_owed.sh 57         # part 57: the experts at prefill sizes (128 to
#                                          #   2,048 rows per expert): the weight-only FP8
#                                          #   kernel against W8A8 (its tiles swept)
#   bash benchmarks/gpu_owed.sh 48         # part 48: cuBLAS block-scaled FP8 against our
#                                          #   W8A8 GEMM (once: the piecewise prefill graphs)
#   bash benchmarks/gpu_owed.sh 40         # part 40: the 4K prefill step and the P/D
#                                          #   posting step before and after the host cuts
#   bash benchmarks/gpu_owed.sh 41         # part 41: parts 39 and 40 shortened, one call
#   bash benchmarks/gpu_owed.sh 42         # part 42: P/D end to end before and after the
#                                          #   decode path's cuts (a P/D arrival hashed while
#                                          #   its READs fly), then the bare NIXL VRAM READ
#   bash benchmarks/gpu_owed.sh 38         # part 38: decode at 2 layers, graphs + async,
#                                          #   with the padded layouts kept on the device
#                                          #   (against docs/decode_h200_1206.md), then the
#                                          #   host-bound 8K rows' idle gaps by host function
#   bash benchmarks/gpu_owed.sh 43         # part 43: the FP8 grouped kernel's decode tiles, the
#                                          #   bf16 kernel at 16 and 64 rows per expert, b = 64
#                                          #   at 16 layers with it
#   bash benchmarks/gpu_owed.sh 44         # part 44: the FP8 grouped kernel at 16 and 64 rows
#                                          #   per expert, FP8 weights at 16 layers, b = 1, 64,
#                                          #   bf16 b = 64 with its verify on the Triton kernel
# each part under 10 minutes on one H200 (every step bounded).
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
    grep -v "loading shards\|NIXL INFO" "$out/$name.log" | tail -${TAIL_LINES:-15}
}
left() { echo $((${PART_SECONDS:-585} - SECONDS)); }  # seconds left of this part
gpu_name() { python -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())"; }
PREFILL_ROWS=docs/prefill_host_h200.json  # the prefill host table of a GPU not measured
gpu_files() {  # the simulator's files of this GPU (docs/parts_*.json, docs/decode_rows_*.json)
    local gpu rows
    gpu=$(gpu_name)
    rows=docs/prefill_host_$gpu.json
    [ -f "$rows" ] || rows=$PREFILL_ROWS
    echo "--parts docs/parts_$gpu.json --decode-rows docs/decode_rows_$gpu.json" \
        "--prefill-rows $rows"
}
calibrate() {  # calibrate SECONDS FILES...: plain at 8K and 32K, then MTP3 at 8K in the rest
    local limit=$1
    shift
    run "$limit" calibration python benchmarks/simulate_calibration.py "$@" \
        --steps-json "$out/calibration_steps.json"
    [ "$(left)" -gt 60 ] && run "$(left)" calibration_mtp3 python \
        benchmarks/simulate_calibration.py "$@" --mtp 3 --contexts 8192 \
        --steps-json "$out/calibration_steps_mtp3.json"
}
part=${1:-1}
run 100 build python -c \
    "from dsaserve.kernels.cuda import build; print('CUDA kernels:', build.build() or 'built')"
if [ "$part" = 1 ]; then
    run 240 tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_hisparse_spill_gpu.py tests/gpu/test_nixl_gpu.py \
        tests/gpu/test_cudagraph_gpu.py tests/gpu/test_pd_hisparse_spill_gpu.py \
        tests/gpu/test_nixl_cancel_gpu.py tests/gpu/test_hisparse_graph_gpu.py
    # NIXL GPU -> GPU between two processes: which UCX protocol; the transport's cuda_ipc GETs
    # (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, disagg/transport.py) against UCX's "auto" (off on one
    # GPU or without NVLink), same card, same call
    run 50 nixl_vram env UCX_PROTO_INFO=y python benchmarks/pd_transfer.py --backends nixl \
        --memory vram --tokens 32768 --repeat 2 --tables transport
    run 50 nixl_vram_auto env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto python \
        benchmarks/pd_transfer.py --backends nixl --memory vram --tokens 32768 --repeat 2 \
        --tables transport
    # the copier's 2 MiB pieces against whole runs, same card, same call
    run 70 offload_whole python benchmarks/offload.py --tables decode --copy-piece-mib 0
    run 70 offload_pieces python benchmarks/offload.py --tables decode
elif [ "$part" = 5 ]; then
    run 240 retests python -m pytest -q -m gpu -rf --tb=short -s -k "not later_turn" \
        tests/gpu/test_block_table_gpu.py \
        tests/gpu/test_hisparse_spill_gpu.py tests/gpu/test_hisparse_graph_gpu.py \
        tests/gpu/test_nixl_cancel_gpu.py tests/gpu/test_hisparse_residency_gpu.py \
        tests/gpu/test_hisparse_fetch_gpu.py
    grep "equal to all-GPU\|READ in flight\|alone equal\|unlike the CPU\|equal pairs\|mtp3 sync" "$out/retests.log"
    run 60 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
    run 60 hisparse python benchmarks/hisparse.py --out "$out/hisparse.md"
    run 70 decode python benchmarks/decode.py --contexts 8192 --batches 1,64 \
        --steps 10 --out "$out/decode.md"
elif [ "$part" = 6 ]; then
    run 200 retests python -m pytest -q -m gpu -rf --tb=short -s \
        -k "eager[fp8-spill-mtp3] or which_path or block_table or cancel or residency or fetch" \
        tests/gpu/test_hisparse_graph_gpu.py tests/gpu/test_block_table_gpu.py \
        tests/gpu/test_nixl_cancel_gpu.py tests/gpu/test_hisparse_residency_gpu.py \
        tests/gpu/test_hisparse_fetch_gpu.py
    grep "equal pairs\|mtp3 sync\|READ in flight" "$out/retests.log"
    run 150 prefill_host python benchmarks/prefill_host.py --lengths 4K --layers 2,4,6 \
        --repeats 5 --no-ops --out "$out/prefill_host.md" --json "$out/prefill_host.json"
    run 90 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
elif [ "$part" = 7 ]; then
    run 260 retests python -m pytest -q -m gpu -rf --tb=short -s \
        -k "order or on_cuda_equal or cpu_reference or staged or (graphs_equal_eager and fp8) or sampler or fetch or residency" \
        tests/gpu/test_topk_order_gpu.py tests/gpu/test_hisparse_spill_gpu.py \
        tests/gpu/test_pd_staged_gpu.py tests/gpu/test_hisparse_graph_gpu.py \
        tests/gpu/test_sampler_gpu.py tests/gpu/test_hisparse_fetch_gpu.py \
        tests/gpu/test_hisparse_residency_gpu.py
    grep "order equal\|unlike the CPU\|equal to all-GPU\|staged\|zero-copy" "$out/retests.log"
    run 110 decode python benchmarks/decode.py --contexts 8192 --batches 1,64 --steps 10 \
        --out "$out/decode.md"
    run 70 hisparse python benchmarks/hisparse.py --out "$out/hisparse.md"
elif [ "$part" = 8 ]; then
    run 150 retests python -m pytest -q -m gpu -rf --tb=short -s -k "order or repeats" \
        tests/gpu/test_topk_order_gpu.py tests/gpu/test_repeatability_gpu.py
    grep "key order\|different token" "$out/retests.log"
    run 100 decode python benchmarks/decode.py --contexts 8192 --batches 1,64 --steps 10 \
        --host-profile 12 --out "$out/decode.md"
    run 90 long_prefill python benchmarks/long_prefill.py --lengths 4K,128K --no-profile \
        --out "$out/long_prefill.md"
elif [ "$part" = 9 ]; then
    run 240 retests python -m pytest -q -m gpu -rf --tb=short -s \
        tests/gpu/test_sampler_gpu.py tests/gpu/test_hisparse_graph_gpu.py \
        tests/gpu/test_hisparse_spill_gpu.py
    grep "near-tie\|gap" "$out/retests.log"  # the fp8 comparisons' margins (0.1 nat assumed)
    run 220 decode python benchmarks/decode.py --contexts 8192,131072 --batches 1,64 \
        --steps 10 --out "$out/decode.md"
elif [ "$part" = 10 ]; then
    run 300 hisparse_engine python benchmarks/hisparse_engine.py --sections step,concurrency \
        --out "$out/hisparse_engine.md"
    run 150 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
    run 120 hisparse_1m python benchmarks/hisparse_engine.py --sections long \
        --out "$out/hisparse_1m.md"
elif [ "$part" = 11 ]; then
    run 170 fp8_tests python -m pytest -q -m gpu -rf --tb=short -s \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_fp8_model_gpu.py \
        tests/gpu/test_cudagraph_gpu.py::test_step_log_times_the_gpu
    for w in bf16 fp8; do
        run 100 "decode_$w" python benchmarks/decode.py --contexts 8192 --batches 1,64 \
            --steps 10 --weights "$w" --out "$out/decode_$w.md"
    done
    run 100 fp8_linear python benchmarks/fp8_linear.py --out "$out/fp8_linear.md"
elif [ "$part" = 12 ]; then
    # every step after the tests bounded by what is left of PART_SECONDS (the call's limit)
    run 150 retests python -m pytest -q -m gpu -rf --tb=short -s \
        tests/gpu/test_hisparse_spill_gpu.py tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fp8_model_gpu.py \
        tests/gpu/test_cudagraph_gpu.py::test_step_log_times_the_gpu
    grep "near-tie" "$out/retests.log"
    [ "$(left)" -gt 60 ] && run "$(left)" hisparse_engine python benchmarks/hisparse_engine.py \
        --sections step,concurrency --out "$out/hisparse_engine.md"
    # fp8_linear above WEIGHT_ONLY_MAX_M: dequantize + cuBLAS
    [ "$(left)" -gt 40 ] && run "$(left)" fp8_linear python benchmarks/fp8_linear.py \
        --m 64,256,4096 --no-grouped --out "$out/fp8_linear.md"
    [ "$(left)" -gt 60 ] && run "$(left)" hisparse_1m python benchmarks/hisparse_engine.py \
        --sections long --out "$out/hisparse_1m.md"
elif [ "$part" = 13 ]; then
    # MTP3 against no MTP at depth (issue 28's targets cannot show at 2 layers), then the FP8
    # 64-row bucket's sweep on two shapes, then P/D end to end (the prefill engine in its
    # own process; NIXL from .whl)
    run 160 decode_16l python benchmarks/decode.py --layers 16 --contexts 8192 \
        --batches 1,64 --steps 10 --out "$out/decode_16l.md"
    run 200 fp8_sweep python benchmarks/fp8_linear.py --m 64 --only q_a,o_proj \
        --no-grouped --sweep --out "$out/fp8_sweep.md"
    run 120 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
elif [ "$part" = 14 ]; then
    # the MoE's routing, pair layout and combine and the top-k's key order compiled (their own
    # tests, then the MoE and engine tests through them: FP8, graphs against eager), the FP8
    # split rule's kernels
    run 240 tests python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_moe_combine_gpu.py \
        tests/gpu/test_routing_gpu.py tests/gpu/test_fp8_linear_gpu.py \
        tests/gpu/test_fp8_model_gpu.py tests/gpu/test_cudagraph_gpu.py \
        tests/gpu/test_topk_order_gpu.py
    run 90 kernels python benchmarks/kernels.py --only moe_combine,routing
    run 60 fp8_linear python benchmarks/fp8_linear.py --m 1,16,64 --no-grouped \
        --out "$out/fp8_linear.md"
    # MTP3 with the MoE kernels; the small kernels by category (Parts.layer_kernels_us)
    [ "$(left)" -gt 90 ] && run 100 decode_16l python benchmarks/decode.py --layers 16 \
        --contexts 8192 --batches 1,64 --steps 10 --fastest-only --kernel-profile 12 \
        --out "$out/decode_16l.md"
    # where P/D's READ step goes (posting, in flight, the rest)
    [ "$(left)" -gt 120 ] && run 90 pd python benchmarks/pd_e2e.py --tokens 32768 \
        --out "$out/pd.md"
    [ "$(left)" -gt 60 ] && run "$(left)" hisparse_step python benchmarks/hisparse_engine.py \
        --sections step --contexts 8192 --out "$out/hisparse_step.md"
elif [ "$part" = 15 ]; then
    # part 14's two failures fixed (the combine's bound where terms cancel; the routing
    # benchmark's near-ties counted), where P/D's 406 ms of posting go, HiSparse's 1M request
    run 60 tests python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_moe_combine_gpu.py
    run 60 kernels python benchmarks/kernels.py --only routing
    run 120 pd python benchmarks/pd_e2e.py --tokens 32768 --profile --out "$out/pd.md"
    [ "$(left)" -gt 120 ] && run "$(left)" hisparse_long python benchmarks/hisparse_engine.py \
        --sections long --out "$out/hisparse_long.md"
elif [ "$part" = 16 ]; then
    # P/D's posting with each process on half the cores; long prefill synchronised against
    # async (part 4 without the 1M repeats)
    run 100 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
    for mode in sync async; do
        flag=$([ "$mode" = async ] && echo --async-scheduling)
        run 210 "long_prefill_$mode" python benchmarks/long_prefill.py --lengths 4K,32K,128K,1M \
            --no-profile $flag --out "$out/long_prefill_$mode.md"
    done
elif [ "$part" = 17 ]; then
    # do HiSparse's and the all-GPU engine's greedy tokens part at near-ties (8K, b = 16 and
    # 64 spill)? the 4K prefill step's host time by operator; MTP3 b = 64 with FP8 weights
    run 240 hisparse_ties python benchmarks/hisparse_engine.py --sections step --contexts 8192 \
        --batches 16,64 --ties --out "$out/hisparse_ties.md"
    run 100 prefill_4k python benchmarks/long_prefill.py --lengths 4K --async-scheduling \
        --out "$out/prefill_4k.md"
    run 150 decode_fp8 python benchmarks/decode.py --layers 16 --contexts 8192 --batches 64 \
        --steps 10 --fastest-only --weights fp8 --out "$out/decode_fp8.md"
elif [ "$part" = 18 ]; then
    # HiSparse on equal batches, token for token (fp8 too); P/D into the host pool over NIXL
    run 150 tests python -m pytest -q -m gpu -rf --tb=short -s \
        tests/gpu/test_hisparse_spill_gpu.py::test_same_batches_equal_tokens \
        tests/gpu/test_pd_hisparse_spill_gpu.py
    # the posting after the plans from runs and pieces, 32K and 128K
    run 100 pd python benchmarks/pd_e2e.py --tokens 32768 131072 --out "$out/pd.md"
    # the 1M request aggregated, then through P/D into a decode engine below one window
    [ "$(left)" -gt 240 ] && run 200 hisparse_long python benchmarks/hisparse_engine.py \
        --sections long,long_pd --out "$out/hisparse_long.md"
    # the step rows on equal batches: do the tokens part?
    [ "$(left)" -gt 60 ] && run "$(left)" hisparse_ties python benchmarks/hisparse_engine.py \
        --sections step --contexts 8192 --batches 16,64 --ties --out "$out/hisparse_ties.md"
elif [ "$part" = 19 ]; then
    # the step rows on equal batches, now that hot rows round as the page path's would
    run 300 hisparse_ties python benchmarks/hisparse_engine.py --sections step --contexts 8192 \
        --batches 16,64 --ties --out "$out/hisparse_ties.md"
    # the 1M request through P/D below one window (its claim names the blocks by digest)
    [ "$(left)" -gt 60 ] && run "$(left)" hisparse_long_pd python benchmarks/hisparse_engine.py \
        --sections long_pd --out "$out/hisparse_long_pd.md"
elif [ "$part" = 20 ]; then
    run 400 hisparse_long_pd python benchmarks/hisparse_engine.py --sections long_pd \
        --profile --out "$out/hisparse_long_pd.md"
elif [ "$part" = 21 ]; then
    run 500 hisparse_long python benchmarks/hisparse_engine.py --sections long,long_pd \
        --out "$out/hisparse_long.md"
elif [ "$part" = 22 ]; then
    run 240 tests python -m pytest -q -m gpu -rf --tb=short -s \
        tests/gpu/test_pd_hisparse_spill_gpu.py tests/gpu/test_hisparse_spill_gpu.py
    [ "$(left)" -gt 200 ] && run "$(left)" hisparse_long python benchmarks/hisparse_engine.py \
        --sections long,long_pd --out "$out/hisparse_long.md"
elif [ "$part" = 23 ]; then
    run 280 parts python benchmarks/kernels.py --only ceilings,prefill,decode,indexer \
        --heads 32 --indices uniform --parts "$out/parts.json"
    [ "$(left)" -gt 60 ] && run "$(left)" decode_rows python benchmarks/decode.py \
        --contexts 8192,32768 --batches 1,8,64 --steps 20 --rows-json "$out/decode_rows.json" \
        --out "$out/decode_rows.md"
elif [ "$part" = 24 ]; then
    files=$(gpu_files)
    calibrate 330 $files
elif [ "$part" = 26 ]; then
    # the host time varies by machine (the same H100 rows measured 1.84-2.36 ms a step on two
    # machines): fit it on this one before calibrating
    gpu=$(gpu_name)
    run 150 decode_rows python benchmarks/decode.py --contexts 8192,32768 --batches 1,2,8 \
        --steps 20 --rows-json "$out/decode_rows.json" --out "$out/decode_rows.md"
    run 150 prefill_host python benchmarks/prefill_host.py --lengths 4K --layers 2,4,6 \
        --repeats 5 --no-ops --json "$out/prefill_host.json" --out "$out/prefill_host.md"
    files="--parts docs/parts_$gpu.json --decode-rows $out/decode_rows.json"
    files="$files --prefill-rows $out/prefill_host.json"
    calibrate 200 $files
elif [ "$part" = 27 ]; then
    gpu=$(gpu_name)
    run 170 tests python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_cudagraph_gpu.py \
        tests/gpu/test_hisparse_graph_gpu.py
    files=$(gpu_files)
    if [ ! -f "docs/parts_$gpu.json" ]; then  # a GPU not measured yet: its parts first
        run 200 parts python benchmarks/kernels.py --only ceilings,prefill,decode,indexer \
            --heads 32 --indices uniform --parts "$out/parts.json"
        files="--parts $out/parts.json --prefill-rows $PREFILL_ROWS"
    fi
    calibrate 220 $files
elif [ "$part" = 28 ]; then
    run 120 pd_overlap python benchmarks/pd_overlap.py --into pages --transports nixl \
        --batch 16 --tokens 131072,131072 --inflight 1 --steps 10 --out "$out/pd_overlap.md"
    files=$(gpu_files)
    calibrate 250 $files
elif [ "$part" = 30 ]; then
    run 120 pd_overlap python benchmarks/pd_overlap.py --into pages --transports nixl \
        --batch 16 --tokens 131072,131072 --inflight 1 --steps 10 --out "$out/pd_overlap.md" \
        --profile-post "$out/post_traces"
    calibrate 250 $(gpu_files)
    [ "$(left)" -gt 90 ] && run "$(left)" calibration_hisparse python \
        benchmarks/simulate_calibration.py $(gpu_files) --hisparse \
        --steps-json "$out/calibration_steps_hisparse.json"
elif [ "$part" = 31 ] || [ "$part" = 32 ]; then
    # 32: the calibration with the prefill probe at two depths first (plain, 8K and 32K), then
    # 31: the 4K prefill step's host share before the host-prep cuts and after, alternating,
    # one machine, one call; the tree before them in old-prep/ (`mkdir old-prep && git archive
    # d7864eb^ | tar -x -C old-prep`, carried, deleted after)
    [ "$part" = 32 ] && run 230 calibration python benchmarks/simulate_calibration.py \
        $(gpu_files) --steps-json "$out/calibration_steps.json"
    for i in 1 2; do
        [ "$(left)" -gt 60 ] && run 80 "prefill_4k_before_$i" env PYTHONPATH="$PWD/old-prep" \
            python old-prep/benchmarks/long_prefill.py --lengths 4K --async-scheduling \
            --out "$out/prefill_4k_before_$i.md"
        [ "$(left)" -gt 60 ] && run 80 "prefill_4k_after_$i" python benchmarks/long_prefill.py \
            --lengths 4K --async-scheduling --out "$out/prefill_4k_after_$i.md"
    done
elif [ "$part" = 33 ]; then
    run 120 pd_overlap python benchmarks/pd_overlap.py --into pages --transports nixl \
        --batch 16 --tokens 131072,131072 --inflight 1 --steps 10 --out "$out/pd_overlap.md" \
        --profile-post "$out/post_traces"
    calibrate 280 $(gpu_files)
elif [ "$part" = 34 ]; then
    run 270 parts python benchmarks/kernels.py --only ceilings,prefill,decode,indexer \
        --heads 32 --indices uniform --parts "$out/parts.json"
    run 140 decode_rows python benchmarks/decode.py --contexts 8192,32768 --batches 1,2,8 \
        --steps 20 --rows-json "$out/decode_rows.json" --out "$out/decode_rows.md"
    run "$(left)" prefill_host python benchmarks/prefill_host.py --lengths 4K --layers 2,4,6 \
        --repeats 5 --no-ops --json "$out/prefill_host.json" --out "$out/prefill_host.md"
elif [ "$part" = 35 ]; then
    gpu=$(gpu_name)
    if [ ! -f "docs/parts_$gpu.json" ]; then
        run 250 parts python benchmarks/kernels.py --only ceilings,prefill,decode,indexer \
            --heads 32 --indices uniform --parts "$out/parts.json"
        cp "$out/parts.json" "docs/parts_$gpu.json"
    fi
    calibrate 280 $(gpu_files)
elif [ "$part" = 36 ]; then
    run 90 prefill_gaps python benchmarks/long_prefill.py --lengths 4K --async-scheduling \
        --gaps 20 --out "$out/prefill_gaps.md"
    TAIL_LINES=8 run 130 pd_transfer python benchmarks/pd_transfer.py --backends nixl \
        --memory vram --tokens 32768 131072 --repeat 2
    run "$(left)" pd python benchmarks/pd_e2e.py --tokens 32768 131072 --out "$out/pd.md"
elif [ "$part" = 37 ]; then
    run 540 calibration_hisparse python benchmarks/simulate_calibration.py $(gpu_files) \
        --hisparse --overlap measured --steps-json "$out/calibration_steps_hisparse.json"
elif [ "$part" = 38 ]; then
    run 280 decode python benchmarks/decode.py --contexts 8192,131072 --batches 1,16,64 \
        --steps 10 --fastest-only --out "$out/decode.md"
    TAIL_LINES=60 run "$(left)" decode_gaps python benchmarks/decode.py --contexts 8192 \
        --batches 1,64 --steps 10 --fastest-only --gaps 12
elif [ "$part" = 39 ]; then
    # the routed experts' grouped GEMM at decode sizes: Triton (bf16, FP8) against
    # torch._grouped_mm, then MTP3 at 16 layers with it (against docs/decode_16l_h100*.md)
    run 150 gpu_tests python -m pytest -q -m "gpu or not gpu" -rf --tb=short tests/gpu/test_fp8_linear_gpu.py \
        tests/unit/test_staging.py tests/gpu/test_block_table_gpu.py tests/gpu/test_sampler_gpu.py
    TAIL_LINES=40 run 150 moe_grouped python benchmarks/moe_grouped.py --out "$out/moe_grouped.md"
    TAIL_LINES=40 run 270 decode16 python benchmarks/decode.py --layers 16 --contexts 8192 \
        --batches 1,64 --steps 10 --fastest-only --kernel-profile 12 --out "$out/decode16.md"
    [ "$(left)" -gt 60 ] && TAIL_LINES=40 run "$(left)" moe_sweep python \
        benchmarks/moe_grouped.py --pairs 2 --sweep bf16
elif [ "$part" = 40 ]; then
    # the host cuts of 2026-12-07, before (out/old: the tree at 26bf5d1, `mkdir -p out/old
    # && git archive 26bf5d1 | tar -x -C out/old`, carried) and after, alternating on one
    # machine: the 4K prefill step (packed uploads, limits per step) and the P/D posting step (the step
    # launched before its READs are posted)
    for i in 1 2; do
        run 75 "prefill_4k_before_$i" env PYTHONPATH="$PWD/out/old" python \
            out/old/benchmarks/long_prefill.py --lengths 4K --async-scheduling \
            --out "$out/prefill_4k_before_$i.md"
        run 75 "prefill_4k_after_$i" python benchmarks/long_prefill.py --lengths 4K \
            --async-scheduling --out "$out/prefill_4k_after_$i.md"
    done
    for tree in before after; do
        dir=$([ "$tree" = before ] && echo out/old || echo .)
        [ "$(left)" -gt 60 ] && TAIL_LINES=12 run 110 "pd_overlap_$tree" \
            env PYTHONPATH="$PWD/$dir:$PYTHONPATH" python "$dir/benchmarks/pd_overlap.py" --into pages \
            --transports nixl --batch 16 --tokens 131072,131072 --inflight 1 --steps 10 \
            --out "$out/pd_overlap_$tree.md"
    done
elif [ "$part" = 41 ]; then
    # parts 39 and 40 shortened into one call (little device time left): the grouped experts
    # and MTP3 at 16 layers, then the 4K prefill step before (out/old: the tree at 26bf5d1,
    # `mkdir -p out/old && git archive 26bf5d1 | tar -x -C out/old`, carried) and after, the
    # P/D posting step after, the packed uploads' GPU tests
    TAIL_LINES=40 run 120 moe_grouped python benchmarks/moe_grouped.py --out "$out/moe_grouped.md"
    TAIL_LINES=30 run 200 decode16 python benchmarks/decode.py --layers 16 --contexts 8192 \
        --batches 1,64 --steps 10 --fastest-only --out "$out/decode16.md"
    [ "$(left)" -gt 70 ] && run 70 prefill_4k_before env PYTHONPATH="$PWD/out/old" python \
        out/old/benchmarks/long_prefill.py --lengths 4K --async-scheduling \
        --out "$out/prefill_4k_before.md"
    [ "$(left)" -gt 70 ] && run 70 prefill_4k_after python benchmarks/long_prefill.py \
        --lengths 4K --async-scheduling --out "$out/prefill_4k_after.md"
    [ "$(left)" -gt 60 ] && TAIL_LINES=12 run "$(left)" pd_overlap python \
        benchmarks/pd_overlap.py --into pages --transports nixl --batch 16 \
        --tokens 131072,131072 --inflight 1 --steps 10 --out "$out/pd_overlap.md"
elif [ "$part" = 42 ]; then
    # P/D on this GPU before (out/old, as part 41) and after the decode path's cuts of
    # 2026-12-07 (its prompt hashed while the READs fly, the claim's answer one request's):
    # end to end at 32K and 128K (the READ step split into posting and flight), then the
    # bare NIXL VRAM READ that part 36 could not run
    for tree in before after; do
        dir=$([ "$tree" = before ] && echo out/old || echo .)
        run 130 "pd_$tree" env PYTHONPATH="$PWD/$dir:$PYTHONPATH" python "$dir/benchmarks/pd_e2e.py" \
            --tokens 32768 131072 --out "$out/pd_$tree.md"
    done
    [ "$(left)" -gt 60 ] && TAIL_LINES=8 run "$(left)" pd_transfer python \
        benchmarks/pd_transfer.py --backends nixl --memory vram --tokens 32768 131072 --repeat 2
elif [ "$part" = 43 ]; then
    # the FP8 grouped kernel's decode tiles (part 39: 27–36 % of the copy rate at 2 pairs,
    # slower than bf16's), the bf16 kernel at 16 and 64 rows per expert with its tiles that
    # fit, then b = 64 at 16 layers with the Triton kernel up to 16 rows per expert
    TAIL_LINES=30 run 290 moe_fp8_sweep python benchmarks/moe_grouped.py --pairs 2,8 \
        --sweep fp8 --out "$out/moe_fp8_sweep.md"
    TAIL_LINES=12 run 70 moe_big python benchmarks/moe_grouped.py --pairs 128,512 \
        --out "$out/moe_big.md"
    [ "$(left)" -gt 60 ] && TAIL_LINES=8 run "$(left)" decode16_b64 python benchmarks/decode.py \
        --layers 16 --contexts 8192 --batches 64 --steps 10 --fastest-only \
        --out "$out/decode16_b64.md"
elif [ "$part" = 49 ]; then
    # after part 47: the projections of one input fused (model/fused.py), the shared experts'
    # silu · up formed while quantized, the experts' rows quantized before their gather,
    # split K summed by the tile's last split, cuBLAS's block-scaled GEMM for the W8A8 rows
    # where it takes the shape, the emitted tokens' log-probabilities from a row
    # log-sum-exp: the GPU tests, then FP8 at 16 layers after (b = 1 and 64, profiled) and
    # before (out/old: the tree at 0e4dc8d, `mkdir -p out/old && git archive 0e4dc8d | tar -x
    # -C out/old`, carried; b = 64). (Its first run gave each tree 150 s: not enough.)
    TAIL_LINES=12 run 130 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_fp8_model_gpu.py \
        tests/gpu/test_sampler_gpu.py
    TAIL_LINES=40 run 260 decode16_fp8_after python benchmarks/decode.py --layers 16 \
        --weights fp8 --contexts 8192 --batches 1,64 --steps 10 --fastest-only \
        --kernel-profile 12 --out "$out/decode16_fp8_after.md"
    [ "$(left)" -gt 90 ] && TAIL_LINES=8 run "$(left)" decode16_fp8_before \
        env PYTHONPATH="$PWD/out/old:$PYTHONPATH" python out/old/benchmarks/decode.py \
        --layers 16 --weights fp8 --contexts 8192 --batches 64 --steps 10 --fastest-only \
        --out "$out/decode16_fp8_before.md"
elif [ "$part" = 50 ]; then
    # part 49 (no machine came for it) with the indexer's key order (row_topk.in_key_order:
    # ranks counted over many programs at few rows, a 32-bit sort at many) in one call: the key
    # order's kernels against each other, the GPU tests, FP8 MTP3 at 16 layers after (b = 1
    # and 64, profiled), then before (out/old: the tree at 0e4dc8d, as part 49) in the rest
    TAIL_LINES=12 run 50 key_order python benchmarks/key_order.py --out "$out/key_order.md"
    TAIL_LINES=12 run 170 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_fp8_model_gpu.py \
        tests/gpu/test_sampler_gpu.py tests/gpu/test_topk_order_gpu.py
    TAIL_LINES=40 run 230 decode16_fp8_after python benchmarks/decode.py --layers 16 \
        --weights fp8 --contexts 8192 --batches 1,64 --steps 10 --fastest-only \
        --kernel-profile 12 --out "$out/decode16_fp8_after.md"
    [ "$(left)" -gt 90 ] && TAIL_LINES=8 run "$(left)" decode16_fp8_before \
        env PYTHONPATH="$PWD/out/old:$PYTHONPATH" python out/old/benchmarks/decode.py \
        --layers 16 --weights fp8 --contexts 8192 --batches 1,64 --steps 10 --fastest-only \
        --out "$out/decode16_fp8_before.md"
elif [ "$part" = 51 ]; then
    # FP8 prefill's products through cuBLAS's block-scaled GEMM (fp8_linear.takes_w8a8 above
    # W8A8_MAX_M rows; since, q_a + wk + kv_a padded to whole blocks takes it too: model/
    # fused.py): the FP8 GPU tests (1,001 and 4,096 rows against w8a8_reference), the
    # projections at prefill rows, then FP8 prefill at 4K-128K after and before (out/prev: the
    # tree at 9298647, `mkdir -p out/prev && git archive 9298647 | tar -x -C out/prev`,
    # carried), alternating
    TAIL_LINES=12 run 150 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_fp8_model_gpu.py
    TAIL_LINES=20 run 90 fp8_linear_prefill python benchmarks/fp8_linear.py --m 1024,4096,16384 \
        --no-grouped --out "$out/fp8_linear_prefill.md"
    for tree in after before; do
        dir=$([ "$tree" = before ] && echo out/prev || echo .)
        [ "$(left)" -gt 60 ] && TAIL_LINES=14 run 120 "prefill_fp8_$tree" \
            env PYTHONPATH="$PWD/$dir:$PYTHONPATH" python "$dir/benchmarks/long_prefill.py" \
            --weights fp8 --lengths 4K,32K,128K --async-scheduling --no-profile \
            --out "$out/prefill_fp8_$tree.md"
    done
elif [ "$part" = 52 ]; then
    # the routed experts' W8A8 grouped GEMM at 17-64 rows per expert (part 47: 2.42 ms of the
    # b = 64 MTP3 step, ~56 % of the copy rate on the weights): every candidate tile
    # (moe_grouped.sweep_w8a8_configs) against GROUPED_TILES
    TAIL_LINES=30 run "$(left)" moe_w8a8_sweep python benchmarks/moe_grouped.py \
        --pairs 128,512 --sweep w8a8 --out "$out/moe_w8a8_sweep.md"
elif [ "$part" = 53 ]; then
    # part 50's one failing GPU test (graphed against eager, tiny-glm5, FP8 kept, bf16: since
    # against its padded steps run eager in both dtypes, and --enforce-eager in fp32), then
    # FP8 at 16 layers, b = 64 plain and MTP3, with the key order's rank count deleted (part
    # 50: 155 µs a call at 64 rows against the 32-bit sort's 16.6)
    PART_SECONDS=${PART_SECONDS:-240}
    TAIL_LINES=20 run 60 failing_test python -m pytest -q -m gpu -rf --tb=short -x \
        "tests/gpu/test_fp8_model_gpu.py::test_fp8_kept_graphs_equal_eager"
    [ "$(left)" -gt 60 ] && TAIL_LINES=10 run "$(left)" decode16_fp8_b64 python \
        benchmarks/decode.py --layers 16 --weights fp8 --contexts 8192 --batches 64 \
        --steps 10 --fastest-only --out "$out/decode16_fp8_b64.md"
elif [ "$part" = 54 ]; then
    # MTP drafts through an FP8 copy of lm_head (SpecConfig.draft_lm_head, the default with FP8
    # weights kept) at GLM-5.3's own vocabulary (154,880: a 1.9 GB bf16 head read once per
    # draft; the benchmark's default 8,192 hides it): the draft-head GPU tests (over every
    # token and over a draft vocabulary), then 16 layers, b = 1 and 64, the drafts' head fp8,
    # fp8 over the first 32,768 ids (SpecConfig.draft_vocab), then model (lm_head), one machine
    TAIL_LINES=12 run 120 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_model_gpu.py tests/gpu/test_kernels_gpu.py \
        -k "draft_head or graphs_equal or rms_norm"
    for head in fp8 fp8-vocab32k model; do
        [ "$(left)" -gt 90 ] && TAIL_LINES=10 run "$(left)" "decode16_vocab_$head" python \
            benchmarks/decode.py --layers 16 --weights fp8 --vocab-size 154880 \
            --draft-lm-head "${head%-vocab32k}" \
            --draft-vocab "$([ "$head" = fp8-vocab32k ] && echo 32768 || echo 0)" \
            --contexts 8192 --batches 1,64 --steps 10 --fastest-only \
            --out "$out/decode16_vocab_$head.md"
    done
elif [ "$part" = 58 ]; then
    # part 54 cut to fit a short device budget: the norms' and draft heads' GPU tests, then b = 1
    # only at GLM-5.3's vocabulary, the drafts through the FP8 copy, then its first 32,768 ids
    TAIL_LINES=12 run 100 gpu_tests python -m pytest -q -m gpu -rf --tb=short -x \
        tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_model_gpu.py \
        -k "rms_norm or draft_head"
    for vocab in 0 32768; do
        [ "$(left)" -gt 60 ] && TAIL_LINES=10 run "$(left)" "decode16_b1_vocab$vocab" python \
            benchmarks/decode.py --layers 16 --weights fp8 --vocab-size 154880 \
            --draft-vocab "$vocab" --contexts 8192 --batches 1 --steps 10 --fastest-only \
            --out "$out/decode16_b1_vocab$vocab.md"
    done
elif [ "$part" = 55 ]; then
    # the routed experts' grouped GEMM with its K range split for decode-sized groups
    # (fp8_linear.choose_grouped_split; part 50: 1.03 ms of the b = 1 step for 1.13 GB of
    # experts, ~27 % of the copy rate): its GPU tests (b = 1 split, graphs), the splits swept,
    # then FP8 at 16 layers after and before (out/old: the tree at a2ef128, `mkdir -p out/old
    # && git archive a2ef128 | tar -x -C out/old`, carried), one machine
    # (since: the residual adds inside the norms, norm.add_rms_norm: its GPU test too, and
    # the after run profiled so that the norms' launches and the experts' time show apart)
    TAIL_LINES=12 run 120 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_kernels_gpu.py -k "grouped or rms_norm"
    TAIL_LINES=40 run 120 moe_split_sweep python benchmarks/moe_grouped.py --pairs 2,8,128 \
        --sweep split --out "$out/moe_split_sweep.md"
    for tree in after before; do
        dir=$([ "$tree" = before ] && echo out/old || echo .)
        profile=$([ "$tree" = after ] && echo "--kernel-profile 12" || true)
        limit=$([ "$tree" = after ] && echo 240 || left)
        [ "$(left)" -gt 90 ] && TAIL_LINES=40 run "$limit" "decode16_fp8_$tree" \
            env PYTHONPATH="$PWD/$dir:$PYTHONPATH" python "$dir/benchmarks/decode.py" \
            --layers 16 --weights fp8 --contexts 8192 --batches 1,64 --steps 10 \
            --fastest-only $profile --out "$out/decode16_fp8_$tree.md"
    done
elif [ "$part" = 56 ]; then
    # the dense products' weight-only FP8 kernel at b = 1 (part 50: 1.53 ms for 3.34 GB, 2.2
    # TB/s): every candidate tile and K split (fp8_linear.py's sweep, ~250 a shape, each
    # compiled: the log keeps what finished) at one row, o_proj and q_b (most of the bytes)
    TAIL_LINES=60 run "$(left)" fp8_linear_b1_sweep python benchmarks/fp8_linear.py --m 1 \
        --only o_proj,q_b --sweep --no-grouped --out "$out/fp8_linear_b1_sweep.md"
elif [ "$part" = 57 ]; then
    # the routed experts at prefill: above 64 rows per expert the engine runs the weight-only
    # FP8 grouped kernel (bf16 MMAs after a per-tile dequantization); the simulator prices
    # it at the bf16 rate and finds the reference's prefill bound by it (docs/simulate.md,
    # fp8-dsaserve). Whether W8A8 (FP8 MMAs) is faster there: both at 128, 512 and 2,048
    # rows per expert, the W8A8 tiles swept
    TAIL_LINES=40 run "$(left)" moe_prefill python benchmarks/moe_grouped.py \
        --pairs 1024,4096,16384 --copies 2 --sweep w8a8 --out "$out/moe_prefill.md"
elif [ "$part" = 48 ]; then
    # cuBLAS's block-scaled FP8 GEMM (PyTorch's scaled_mm, 1 x 128 and 128 x 128 scales)
    # against our W8A8 kernel from 128 to 4,096 rows. (Part 48 once ran the piecewise prefill
    # graphs' GPU tests and 4K steps, at d4cea17: measured, deleted; docs/long_prefill.md.)
    TAIL_LINES=30 run 150 cublas_blockwise python benchmarks/fp8_cublas_blockwise.py \
        --out "$out/cublas_blockwise.md"
elif [ "$part" = 47 ]; then
    # the W8A8 MoE GPU test's bound as changed after part 46 (the whole file), then where FP8
    # MTP3's step goes now, b = 1 and 64 (the W8A8 kernels counted as MoE + GEMMs)
    TAIL_LINES=12 run 120 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_fp8_model_gpu.py
    [ "$(left)" -gt 60 ] && TAIL_LINES=40 run "$(left)" decode16_fp8_profile python \
        benchmarks/decode.py --layers 16 --weights fp8 --contexts 8192 --batches 1,64 \
        --steps 10 --fastest-only --kernel-profile 12 --out "$out/decode16_fp8_profile.md"
elif [ "$part" = 46 ]; then
    # W8A8 for the FP8 experts at 17-64 rows per expert (fp8_w8a8.w8a8_grouped): the GPU tests,
    # the grouped GEMMs at 128 and 512 pairs (w8a8 rows beside the weight-only FP8 kernel), then
    # MTP3 at b = 64 with FP8 weights (17.7 ms with W8A8 for the dense projections only)
    TAIL_LINES=12 run 120 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py
    TAIL_LINES=40 run 100 moe_w8a8 python benchmarks/moe_grouped.py --pairs 128,512 \
        --out "$out/moe_w8a8.md"
    [ "$(left)" -gt 60 ] && TAIL_LINES=16 run "$(left)" decode16_fp8_b64 python \
        benchmarks/decode.py --layers 16 --weights fp8 --contexts 8192 --batches 64 --steps 10 \
        --fastest-only --out "$out/decode16_fp8_b64.md"
elif [ "$part" = 45 ]; then
    # W8A8 for FP8 projections from 65 to 256 rows (fp8_w8a8.py): its GPU tests (act_quant's
    # bytes, the product against its reference), then its tiles at 256 rows from CUDA graphs
    # (the engine's verify is graphed; eager timings of these short kernels are launch-bound)
    TAIL_LINES=12 run 120 gpu_tests python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_fp8_linear_gpu.py
    TAIL_LINES=40 run "$(left)" w8a8_sweep python benchmarks/fp8_linear.py --m 256 \
        --graph-max-m 256 --only q_a,kv_a,q_b,o_proj --no-grouped --sweep --out "$out/w8a8.md"
elif [ "$part" = 44 ]; then
    # the FP8 grouped kernel at 16 and 64 rows per expert (its prefill-sized tiles there),
    # then the deployment's weights at 16 layers, b = 1 and 64
    TAIL_LINES=30 run 300 moe_fp8_big python benchmarks/moe_grouped.py --pairs 128,512 \
        --sweep fp8 --out "$out/moe_fp8_big.md"
    [ "$(left)" -gt 60 ] && TAIL_LINES=16 run 170 decode16_fp8 python benchmarks/decode.py \
        --layers 16 --weights fp8 --contexts 8192 --batches 1,64 --steps 10 --fastest-only \
        --out "$out/decode16_fp8.md"
    # bf16 b = 64 again: its MTP3 verify (64 rows per expert) on the Triton kernel since the
    # threshold is 64 (part 43 ran it on CUTLASS: 16.75 ms)
    [ "$(left)" -gt 60 ] && TAIL_LINES=8 run "$(left)" decode16_b64 python benchmarks/decode.py \
        --layers 16 --contexts 8192 --batches 64 --steps 10 --fastest-only \
        --out "$out/decode16_b64.md"
elif [ "$part" = 29 ]; then
    files=$(gpu_files)
    run 540 calibration_hisparse python benchmarks/simulate_calibration.py $files --hisparse \
        --steps-json "$out/calibration_steps_hisparse.json"
elif [ "$part" = 25 ]; then
    run 280 pd_overlap python benchmarks/pd_overlap.py --into pages --out "$out/pd_overlap.md"
    [ "$(left)" -gt 60 ] && run "$(left)" pd_overlap_host python benchmarks/pd_overlap.py \
        --into host-pool --batch 16 --out "$out/pd_overlap_host.md"
elif [ "$part" = 4 ]; then
    # chunked prefill with --async-scheduling (chunk k + 1's host work under chunk k's kernels)
    # against synchronised steps, same card, same call
    for mode in sync async; do
        flag=$([ "$mode" = async ] && echo --async-scheduling)
        run 200 "long_prefill_$mode" python benchmarks/long_prefill.py --lengths 4K,32K,128K,1M \
            --no-profile $flag --out "$out/long_prefill_$mode.md"
    done
    # does the 1M prompt's first token repeat with the top-k in key order? (the sync run's is
    # the first of three)
    for i in 2 3; do
        run 80 "long_1m_$i" python benchmarks/long_prefill.py --lengths 1M --no-profile \
            --out "$out/long_1m_$i.md"
    done
elif [ "$part" = 3 ]; then
    # is a prefill step's host time per layer or per step? (2, 4, 8 layers; the simulator's
    # host term scales it with layers today)
    run 420 prefill_host python benchmarks/prefill_host.py --out "$out/prefill_host.md" \
        --json "$out/prefill_host.json"
else
    run 90 residency python -m pytest -q -m gpu -rf --tb=short \
        tests/gpu/test_hisparse_residency_gpu.py tests/gpu/test_hisparse_fetch_gpu.py
    run 60 hisparse python benchmarks/hisparse.py --out "$out/hisparse.md"
    run 60 pd python benchmarks/pd_e2e.py --tokens 32768 --out "$out/pd.md"
    run 150 decode python benchmarks/decode.py --contexts 8192,131072 --batches 1,64 \
        --steps 10 --out "$out/decode.md"
    run 150 calibration python benchmarks/simulate_calibration.py
fi
