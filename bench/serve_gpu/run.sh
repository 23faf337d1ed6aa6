#!/usr/bin/env bash
# On the lent GPU machine, from the repo root, with .device_model and .whl carried (README.md):
#   bash bench/serve_gpu/run.sh "$OUT" [SECONDS] [STEP ...]
# Everything it measures lands in OUT/run.tar.gz, packed again after each step (the device tool
# brings back at most 8 files: the twelve of a full run lost four), and its tables in
# OUT/tables.md. Steps (default: all, in this order) run in order of value; once SECONDS (default
# 480) have passed, the steps not yet started are skipped (steps.txt says which), so the call
# ends inside its limit.
set -uo pipefail
dest=${1:?usage: run.sh OUT_DIR [SECONDS] [STEP ...]}
out=$(mktemp -d)
pack() { tar czf "$dest/run.tar.gz" -C "$out" .; }
budget=${2:-480}
shift $(( $# >= 2 ? 2 : 1 ))
steps=${*:-tests graphs profile eager hf served served-switch fp8 kv-fp8}
py=python3
# the image lacks pydantic, fastapi, uvicorn and compressed-tensors: wheels carried in .whl
if compgen -G ".whl/*.whl" > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
time_left() {  # a step starts only while the budget lasts
  if (( SECONDS >= budget )); then echo "skipped at ${SECONDS}s: $*" | tee -a "$out/steps.txt"; return 1; fi
  echo "start at ${SECONDS}s: $*" | tee -a "$out/steps.txt"
}
# one engine per call, its levels one after another (a level's JSON line is written as it ends)
bench() { timeout 150 $py bench/serve_engine/throughput.py --device cuda --dtype bfloat16 "$@"; }
bf16=/tmp/smollm2-bf16 fp8=/tmp/smollm2-fp8
# `qpipe serve` on the bf16 model, with Python code run first ($2), measured by `qpipe bench`;
# the server threads' CPU seconds (/proc) at the end tell the event loop's share
served() {
  $py -c "import runpy, sys; $2; runpy.run_module('qpipe', run_name='__main__')" serve $bf16 \
    --device cuda --dtype bfloat16 --max-num-seqs 256 --gpu-memory-utilization 0.3 \
    --port 8321 > "$out/serve-$1.log" 2>&1 &
  local server=$!
  for _ in $(seq 120); do
    curl -sf localhost:8321/health > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 1
  done
  timeout 120 $py -m qpipe bench --endpoint http://127.0.0.1:8321 --concurrency 1,32,256 \
    --input-len 128 --output-len 64 --result-file "$out/served-$1.jsonl" 2>&1 | tail -25
  curl -s localhost:8321/metrics | grep -E "^qpipe:(num_preemptions|generation_tokens)_total"
  grep -H . /proc/$server/task/*/comm /proc/$server/task/*/stat > "$out/serve-$1-threads.txt"
  kill -INT $server; wait $server
}
# random weights in SmolLM2's shapes: bf16 for speed, fp32 where the tests compare tokens
$py bench/serve_gpu/random_weights.py .device_model $bf16 --dtype bfloat16 || exit 1

for step in $steps; do
  case $step in
  tests)  # on the GPU: CUDA-graph replay vs eager, fp8 tensor cores, the Triton kernels; not
    # the interpreter tests (CI's job: the image's Triton 3.6 interpreter fails on a loop bound
    # loaded from a tensor, and they would spend device time on CPU work)
    mkdir -p /tmp/qcache
    $py bench/serve_gpu/random_weights.py .device_model /tmp/qcache/smollm2-135m-fp32 --dtype float32 || exit 1
    time_left tests && QPIPE_TEST_CACHE=/tmp/qcache timeout 180 $py -m pytest -q -p no:cacheprovider \
      -k "not interpreter" \
      tests/test_decode_graphs.py tests/test_fp8_linear.py tests/test_triton_weight_only.py \
      tests/test_serve_engine.py::test_the_whole_model_lands_on_the_serving_device \
      tests/test_triton_elementwise.py::test_triton_elementwise_kernels_equal_the_eager_ops_on_the_gpu \
      tests/test_triton_attention.py::test_triton_context_attention_equals_sdpa_on_the_gpu \
      tests/test_triton_warm_up.py::test_serving_on_the_gpu_compiles_nothing_after_start \
      2>&1 | tee "$out/tests.txt" ;;
  graphs)  # issue 6's load (128 in, 64 out, greedy), bf16, CUDA graphs on
    time_left graphs && bench $bf16 --concurrency 1 8 32 64 128 256 --json "$out/results.jsonl" ;;
  eager)
    time_left eager && bench $bf16 --concurrency 1 32 256 --enforce-eager --json "$out/results.jsonl" ;;
  hf)  # the peer the GPU image has: transformers generate, static batches, same load
    time_left "hf generate" && timeout 120 $py bench/serve_gpu/hf_peer.py $bf16 \
      --concurrency 1 32 256 --json "$out/results.jsonl" ;;
  served)  # over HTTP (qpipe serve + qpipe bench, streaming): what a client of the server sees
    time_left served && served default pass ;;
  served-switch)  # the same with the GIL handed over every 0.5 ms, not 5: the engine thread
    # waits for the GIL after each op that releases it, while the event loop streams
    time_left served-switch && served switch-0.5ms "sys.setswitchinterval(5e-4)" ;;
  fp8)  # the FP8_DYNAMIC layout on fp8 tensor cores (torch._scaled_mm), graphs on
    time_left fp8 || continue
    $py bench/serve_gpu/random_weights.py .device_model $fp8 --fp8 || continue
    bench $fp8 --concurrency 32 256 --json "$out/results-fp8.jsonl" ;;
  kv-fp8)  # an fp8 KV cache under bf16 compute, where decode attention reads the most
    time_left kv-fp8 && bench $bf16 --kv-cache-dtype fp8 --concurrency 64 256 --json "$out/results-kv-fp8.jsonl" ;;
  profile)  # host against device time per op and per kind of step at c=64: the first run's steps
    # with prompts took ~80-150 ms against 3-4 ms decode steps (implied by its wall time), and the
    # decode step grew 22 us per sequence
    time_left profile && bench $bf16 --concurrency 64 --profile > "$out/profile-c64.txt" 2>&1 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  pack
done
for results in "$out"/results*.jsonl; do
  [ -f "$results" ] || continue
  model=$bf16; [[ $results == */results-fp8.jsonl ]] && model=$fp8
  { echo "## $(basename "$results")"; $py bench/serve_gpu/report.py "$results" $model; echo; } \
    | tee -a "$out/tables.md"
done
pack
cp "$out/tables.md" "$dest/" 2> /dev/null
echo "done at ${SECONDS}s"
