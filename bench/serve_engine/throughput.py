"""Offline engine throughput: closed loop at a fixed concurrency, 128-token prompts, 64 output
tokens, greedy (issue 6's load shape). Not a test: numbers depend on what else runs on the machine.

    .venv/bin/python bench/serve_engine/throughput.py CHECKPOINT_OR_ARTIFACT [--concurrency 32]

Several concurrencies (`--concurrency 1 8 32`) run one after another on one engine, each with
prompts of its own (no prefix-cache hit across levels): on a lent GPU an engine start (load,
profiling pass, CUDA-graph capture) takes ~20 s, as long as a level's run. `--json FILE` appends
each level's figures as one JSON line (bench/serve_gpu/ collects its table that way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from qpipe.bench.machine_speed import measure
from qpipe.bench.metrics import Distribution
from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument(
        "--requests", type=int, default=0, help="per level; default 2 x concurrency"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens
    )
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="append each level's figures to this file as a JSON line")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(*args.concurrency, EngineConfig.max_num_seqs),
            enforce_eager=args.enforce_eager,
        )
    )
    gen = torch.Generator().manual_seed(0)
    # warm-up with a prompt of the measured length but not among them (no prefix-cache hit): the
    # first step of a new shape may pay one-off costs (the H200 run of a 16-token warm-up: c=1 TTFT
    # p99 0.69 s for a 2.7 ms decode step)
    (warmup,) = token_prompts(engine, gen, 1, args.prompt_len)
    engine.generate([warmup], SamplingParams(max_tokens=2, temperature=0))
    for concurrency in args.concurrency:
        figures = run_level(engine, args, concurrency, gen)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(figures) + "\n")


def token_prompts(
    engine: LLMEngine, gen: torch.Generator, count: int, length: int
) -> list[list[int]]:
    vocab = len(engine.tokenizer)
    return [
        torch.randint(100, vocab - 100, (length,), generator=gen).tolist() for _ in range(count)
    ]


def run_level(
    engine: LLMEngine, args: argparse.Namespace, concurrency: int, gen: torch.Generator
) -> dict[str, object]:
    """One closed-loop level: `concurrency` requests in flight until all have finished."""
    total = args.requests or 2 * concurrency
    prompts = token_prompts(engine, gen, total, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    speed = measure() if args.device == "cpu" else None  # a shared VM's speed drifts: say it
    preempted_before = engine.stats().num_preemptions
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    next_prompt = 0
    steps = 0
    profiler = torch.profiler.profile() if args.profile else None
    start = time.perf_counter()
    cpu_start = time.process_time()
    if profiler:
        profiler.start()
    decode_steps: list[float] = []  # steps with nothing admitted: decodes only at this load
    prompt_steps: list[float] = []  # the others: each runs prompt tokens (and any decodes)
    while len(done) < total:
        admitted = False
        while next_prompt < total and len(added) - len(done) < concurrency:
            request_id = f"{concurrency}-{next_prompt}"
            engine.add_request(request_id, prompts[next_prompt], params)
            added[request_id] = time.perf_counter()
            next_prompt += 1
            admitted = True
        decode_only = not admitted and engine.stats().num_waiting == 0
        # the profile's tables then say what each kind of step spent, on the host and the GPU
        label = "step: decodes only" if decode_only else "step: with prompts"
        labelled = torch.profiler.record_function(label) if profiler else contextlib.nullcontext()
        step_start = time.perf_counter()
        with labelled:
            outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        (decode_steps if decode_only else prompt_steps).append(now - step_start)
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    if profiler:
        profiler.stop()
        averages = profiler.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
        if args.device == "cuda":  # what the GPU ran, against the host time above
            print(averages.table(sort_by="self_device_time_total", row_limit=15))
        for event in averages:
            if event.key.startswith("step: "):
                print(
                    f"{event.key}: {event.count} steps, host {event.cpu_time_total / 1e3:.1f} ms, "
                    f"device {event.device_time_total / 1e3:.1f} ms"
                )
    # the same definitions as `qpipe bench` and `vllm bench serve`
    ttft = Distribution.of([first[r] - added[r] for r in added])
    tpot = Distribution.of([(done[r] - first[r]) / (args.output_len - 1) for r in added])
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    figures = {
        "model": args.model,
        "device": args.device,
        "dtype": str(engine.model_runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": engine.model_runner.kv_cache_dtype_name,
        "preemptions": stats.num_preemptions - preempted_before,
        "cuda_graphs": engine.model_runner.decode_graphs is not None,
        "concurrency": concurrency,
        "requests": total,
        "output_tok_s": total * args.output_len / elapsed,
        "ttft_p50_s": ttft.median / 1e3,
        "ttft_p99_s": ttft.percentiles[99] / 1e3,
        "tpot_p50_ms": tpot.median,
        "tpot_p99_ms": tpot.percentiles[99],
        "steps": steps,
        "decode_step_p50_ms": statistics.median(decode_steps) * 1e3 if decode_steps else None,
        # steps with prompts are eager on a GPU (no CUDA graph) and set TTFT
        "prompt_steps": len(prompt_steps),
        "prompt_step_p50_ms": statistics.median(prompt_steps) * 1e3 if prompt_steps else None,
        "prompt_step_max_ms": max(prompt_steps) * 1e3 if prompt_steps else None,
        "wall_s": elapsed,
        "machine_speed": speed.to_json() if speed else None,
    }
    print(
        f"concurrency {concurrency}, {total} requests, {steps} steps, "
        f"{torch.get_num_threads()} threads: {figures['output_tok_s']:.1f} output tok/s, "
        f"TTFT p50 {figures['ttft_p50_s']:.2f}s p99 {figures['ttft_p99_s']:.2f}s, "
        f"TPOT p50 {figures['tpot_p50_ms']:.0f}ms, {figures['preemptions']} preemptions, "
        f"{elapsed:.1f}s wall, {cpu:.1f}s CPU"
    )
    for kind, times in (("decodes only", decode_steps), ("with prompts", prompt_steps)):
        if times:
            print(
                f"  {len(times)} steps {kind}: p50 {statistics.median(times) * 1e3:.2f} ms, "
                f"max {max(times) * 1e3:.2f} ms"
            )
    if speed:
        print(f"machine before the run: {speed.describe()}")
    return figures


if __name__ == "__main__":
    main()
