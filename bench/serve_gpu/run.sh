#!/usr/bin/env bash
# On the lent GPU machine, from the repo root, with .device_model carried (see README.md):
#   bash bench/serve_gpu/run.sh "$OUT"
# Everything it measures lands in OUT: env.txt, tests.txt, results.jsonl, table.md.
set -uo pipefail
out=${1:?usage: run.sh OUT_DIR}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=python3
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1; } > "$out/env.txt" 2>&1
cat "$out/env.txt"

# random weights in SmolLM2's shapes: bf16 for speed, fp32 where the tests compare tokens
$py bench/serve_gpu/random_weights.py .device_model /tmp/smollm2-bf16 --dtype bfloat16 || exit 1
mkdir -p /tmp/qcache
$py bench/serve_gpu/random_weights.py .device_model /tmp/qcache/smollm2-135m-fp32 --dtype float32 || exit 1
$py bench/serve_gpu/random_weights.py .device_model /tmp/smollm2-fp8 --fp8 || exit 1

# correctness on the GPU first: CUDA-graph replay vs eager, fp8 tensor cores vs exact fp8
# products, the weight-only Triton kernel vs the eager layer (and the CPU-side tests of the files)
QPIPE_TEST_CACHE=/tmp/qcache timeout 180 $py -m pytest -q -p no:cacheprovider \
  tests/test_decode_graphs.py tests/test_fp8_linear.py tests/test_triton_weight_only.py \
  2>&1 | tee "$out/tests.txt"

# throughput: issue 6's load (128 in, 64 out, greedy), bf16, graphs on; eager at three points
for c in 1 8 32 64 128 256; do
  timeout 60 $py bench/serve_engine/throughput.py /tmp/smollm2-bf16 --device cuda \
    --dtype bfloat16 --concurrency "$c" --json "$out/results.jsonl"
done
for c in 1 32 256; do
  timeout 60 $py bench/serve_engine/throughput.py /tmp/smollm2-bf16 --device cuda \
    --dtype bfloat16 --concurrency "$c" --enforce-eager --json "$out/results.jsonl"
done
$py bench/serve_gpu/report.py "$out/results.jsonl" /tmp/smollm2-bf16 | tee "$out/table.md"

# the FP8_DYNAMIC layout on fp8 tensor cores (torch._scaled_mm), graphs on, last: it may not fit
for c in 32 256; do
  timeout 60 $py bench/serve_engine/throughput.py /tmp/smollm2-fp8 --device cuda \
    --dtype bfloat16 --concurrency "$c" --json "$out/results-fp8.jsonl"
done
$py bench/serve_gpu/report.py "$out/results-fp8.jsonl" /tmp/smollm2-fp8 | tee "$out/table-fp8.md"

# an fp8 KV cache (--kv-cache-dtype fp8) under bf16 compute, at the two loads where decode
# attention reads the most: Triton widens e4m3 on load
for c in 64 256; do
  timeout 60 $py bench/serve_engine/throughput.py /tmp/smollm2-bf16 --device cuda \
    --dtype bfloat16 --kv-cache-dtype fp8 --concurrency "$c" --json "$out/results-kv-fp8.jsonl"
done
$py bench/serve_gpu/report.py "$out/results-kv-fp8.jsonl" /tmp/smollm2-bf16 | tee "$out/table-kv-fp8.md"
