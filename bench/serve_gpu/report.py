"""The H200 table from throughput.py's JSON lines: output tok/s, TTFT and TPOT, and each decode
step against the memory-bandwidth floor — the bytes a step must read (all weights once, plus the
K/V of every running sequence at its mean context) over the GPU's copy bandwidth.

    python3 bench/serve_gpu/report.py RESULTS.jsonl CHECKPOINT [--bandwidth-tb-s 4.3]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from safetensors import safe_open
from transformers import AutoConfig

from qpipe.serve.models.llama import head_dim_of

PROMPT_LEN, OUTPUT_LEN = 128, 64
# bytes per cached K or V value by throughput.py's kv_cache_dtype (2 for lines without one)
KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def weight_bytes(checkpoint: Path) -> int:
    """Bytes of weights a step reads: fp8 weights as stored, everything else served in bf16."""
    total = 0
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                part = f.get_slice(name)
                size = 1 if part.get_dtype().startswith("F8") else 2
                total += math.prod(part.get_shape()) * size
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--bandwidth-tb-s", type=float, default=4.3)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.checkpoint)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    kv_per_token = 2 * layers * kv_heads * head_dim_of(config) * 2  # K and V, 2 bytes each
    weights = weight_bytes(args.checkpoint)
    mean_context = PROMPT_LEN + OUTPUT_LEN / 2
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    print(
        f"weights {weights / 1e6:.0f} MB, K/V {kv_per_token / 1e3:.1f} kB per token in 16 bits; "
        f"floor = (weights + running x {mean_context:.0f} tokens of K/V) / "
        f"{args.bandwidth_tb_s} TB/s\n"
    )
    print(
        "| engine | concurrency | CUDA graphs | output tok/s | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | decode step p50 (ms) | floor (ms) | step / floor "
        "| steps with prompts: p50 / max (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(
        rows, key=lambda r: (r.get("engine", "qpipe"), not r["cuda_graphs"], r["concurrency"])
    ):
        kv_bytes = kv_per_token // 2 * KV_ELEMENT_BYTES.get(r.get("kv_cache_dtype", ""), 2)
        floor = (weights + r["concurrency"] * mean_context * kv_bytes) / (
            args.bandwidth_tb_s * 1e12
        )
        step = r["decode_step_p50_ms"]
        step_cells = "- | - | -"
        if step:
            step_cells = f"{step:.3f} | {floor * 1e3:.3f} | {step / (floor * 1e3):.1f}x"
        prompt_cell = "-"  # lines from before throughput.py timed them
        if r.get("prompt_step_p50_ms"):
            prompt_cell = f"{r['prompt_step_p50_ms']:.1f} / {r['prompt_step_max_ms']:.1f}"
        print(
            f"| {r.get('engine', 'qpipe')} | {r['concurrency']} "
            f"| {'yes' if r['cuda_graphs'] else 'no'} "
            f"| {r['output_tok_s']:.0f} "
            f"| {r['ttft_p50_s'] * 1e3:.1f} / {r['ttft_p99_s'] * 1e3:.1f} "
            f"| {r['tpot_p50_ms']:.2f} / {r['tpot_p99_ms']:.2f} | {step_cells} | {prompt_cell} |"
        )


if __name__ == "__main__":
    main()
