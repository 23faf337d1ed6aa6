"""The peer the H200 table can have: Hugging Face `generate` on static batches, on the GPU, with
the load throughput.py puts on qpipe (128-token prompts, 64 output tokens, greedy, 2 x C prompts).
vLLM cannot travel to the device machine (no registry there, and its CUDA wheel is far over the
64 MiB a call carries), so transformers, which the GPU image ships, is the peer there.

    python3 bench/serve_gpu/hf_peer.py CHECKPOINT --concurrency 1 32 256 --json OUT.jsonl

It writes throughput.py's JSON keys, with `"engine": "hf"`, so report.py puts it in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve_compare"))
from hf_generate import run_hf_generate  # noqa: E402 - the sibling bench folder's module

from qpipe.bench.config import LoadProfile  # noqa: E402
from qpipe.bench.dataset import load_tokenizer  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    profiles = [
        LoadProfile(input_len=PROMPT_LEN, output_len=OUTPUT_LEN, concurrency=c, num_prompts=2 * c)
        for c in args.concurrency
    ]
    tokenizer = load_tokenizer(args.checkpoint)
    with Progress() as progress:
        levels = run_hf_generate(
            args.checkpoint, tokenizer, profiles, 0, progress, args.device, args.dtype
        )
    with args.json.open("a") as f:
        for level in levels:
            m = level.metrics
            ttft, tpot = m.latencies["ttft"], m.latencies["tpot"]
            row = {
                "engine": "hf",
                "model": str(args.checkpoint),
                "device": args.device,
                "dtype": args.dtype,
                "cuda_graphs": False,
                "concurrency": level.profile.concurrency,
                "requests": m.completed,
                "output_tok_s": m.output_throughput,
                "ttft_p50_s": ttft.median / 1e3,
                "ttft_p99_s": ttft.percentiles[99] / 1e3,
                "tpot_p50_ms": tpot.median,
                "tpot_p99_ms": tpot.percentiles[99],
                "decode_step_p50_ms": None,
                "wall_s": m.duration,
            }
            print(json.dumps(row))
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
