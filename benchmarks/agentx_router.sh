#!/usr/bin/env bash
# The AgentX harness through `dsaserve router` over two `dsaserve serve` replicas (tiny model, CPU,
# 127.0.0.1 only); docs/router.md has the table it produced.
#
#   bash benchmarks/agentx_router.sh POLICY TRACE_DIR HARNESS OUT_DIR
#   e.g. bash benchmarks/agentx_router.sh prefix out/ax-trace ../agentx-venv/bin/agentx out/ax-prefix
#
# POLICY: prefix | load | round-robin. TRACE_DIR: `python -m dsaserve.bench.traces DIR`.
# Fresh replicas each run, so one policy's cache never helps the next.
set -u
policy=$1; trace=$2; harness=$3; out=$4
cd "$(dirname "$0")/.."
bin=.venv/bin
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
wait_up() { for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; echo "port $1 did not come up" >&2; exit 1; }
for port in 8101 8102; do
  $bin/dsaserve serve --device cpu --port $port > "/dev/null" 2>&1 & pids+=($!)
done
wait_up 8101; wait_up 8102
$bin/dsaserve router --backend http://127.0.0.1:8101 --backend http://127.0.0.1:8102 \
  --policy "$policy" --port 8110 > /dev/null 2>&1 & pids+=($!)
wait_up 8110
model_dir=$($bin/python -c 'from dsaserve.engine.args import resolve_model; print(resolve_model())')
$bin/python -m dsaserve.bench.agentx --trace "$trace" --url http://127.0.0.1:8110 \
  --tokenizer "$model_dir" --harness "$harness" --concurrency 8 --duration 60 --num-gpus 2 \
  --artifact-dir "$out"
echo "per replica (requests, prefix-cache queries and hits):"
for port in 8101 8102; do
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(request_success|prefix_cache_(queries|hits))_total'
done
