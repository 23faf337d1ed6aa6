"""Offline: what a structured output costs. The same chat prompts at one concurrency, greedy,
first without a constraint and then held to a JSON schema, interleaved over the trials; prints
the output tok/s of each and how many outputs parse as JSON. Not a test.

    .venv/bin/python bench/serve_engine/structured.py CHECKPOINT_OR_ARTIFACT [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
}
TOPICS = ["a painter", "a sailor", "a chemist", "a baker", "a pilot", "a poet", "a nurse"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_memory_gib=1.0))
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(args.concurrency)
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    held = replace(free, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    engine.generate([ids[0]], held)  # warm-up, and the schema compiled once

    for trial in range(args.trials):
        for label, params in (("free", free), ("json schema", held)):
            tokens = valid = 0
            start = time.perf_counter()
            outs = engine.generate(ids, params)
            elapsed = time.perf_counter() - start
            for out in outs:
                tokens += len(out)
                try:
                    json.loads(tokenizer.decode(out, skip_special_tokens=True))
                    valid += 1
                except json.JSONDecodeError:
                    pass
            print(
                f"trial {trial} {label:>11}: {tokens / elapsed:6.1f} output tok/s, "
                f"{tokens} tokens, {valid}/{len(outs)} parse as JSON"
            )


if __name__ == "__main__":
    main()
