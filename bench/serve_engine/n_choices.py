"""Offline: the n seeded choices of one prompt, sent together as the server sends a request with
`n`. Prints the time to every choice's first token and to the end, and the prefix-cache hits, so
a change to how the choices share their prompt shows. Not a test.

    .venv/bin/python bench/serve_engine/n_choices.py CHECKPOINT_OR_ARTIFACT [--n 8 --prompt-len 480]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=480)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model, dtype=args.dtype, kv_cache_memory_gib=1.0,
            max_model_len=args.prompt_len + args.output_len + 16,
        )
    )  # fmt: skip
    vocab = len(engine.tokenizer)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.8, ignore_eos=True)
    engine.generate([[100] * 16], replace(params, max_tokens=2))  # warm-up
    gen = torch.Generator().manual_seed(0)
    for trial in range(args.trials):
        prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist()
        hits_before = engine.stats().prefix_cache_hits
        start = time.perf_counter()
        for j in range(args.n):
            engine.add_request(f"{trial}-{j}", prompt, replace(params, seed=j))
        first: dict[str, float] = {}
        while engine.has_unfinished():
            for out in engine.step():
                first.setdefault(out.request_id, time.perf_counter() - start)
        end = time.perf_counter() - start
        hits = engine.stats().prefix_cache_hits - hits_before
        last_first = max(first.values())
        print(
            f"n={args.n}, prompt {args.prompt_len} tokens: last first token {last_first:.2f} s, "
            f"all done {end:.2f} s, prefix-cache hits {hits} tokens"
        )


if __name__ == "__main__":
    main()
