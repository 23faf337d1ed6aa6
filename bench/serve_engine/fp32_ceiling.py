"""How close fp32 serving gets to what this CPU's FMAs allow, for issue 6's load (128-token
prompts, 64 output tokens, greedy). Not a test: it measures the machine.

    .venv/bin/python bench/serve_engine/fp32_ceiling.py CHECKPOINT [--peer TOK_S] [--engine]

Why: issue 6 puts SmolLM2's fp32 ceiling "near 1,000 tok/s" from ~0.27 GFLOP per token, which
counts one forward per output token. Every output token of this load also carries two prompt
tokens (128 in, 64 out), so the arithmetic per output token is about 2.6 times that. The ceiling
that follows is the FMA peak over that count, with nothing else in a step: no attention memory
traffic, no norms, no host work. The script measures the peak with a loop of independent
multiply-add chains (g++, `-march=native`), counts the load's arithmetic from the checkpoint's
config (and checks the count against the checkpoint's weight shapes), then says what fraction
of the ceiling a figure is: a peer's (`--peer`, e.g. vLLM fp32's served output tok/s), 1.5 times
it, and qpipe's own offline engine at concurrency 32 in fp32 (`--engine`, ~1 minute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qpipe.fit import ModelShape, load_shape

# Independent accumulators per thread, more than the FMA latency times the FMA ports (4 x 2 on
# Zen 3/4 and recent Intel), so that the loop waits on throughput, not on a chain.
FMA_PROBE = r"""
#include <chrono>
#include <cstdio>
#include <omp.h>
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
constexpr int kChains = 12;
int main() {
  const long iters = 1000000000L / (sizeof(vec) / 4);
  double best = 0.0, sink = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
      threads = omp_get_num_threads();
      vec acc[kChains], a, b;
      for (int l = 0; l < (int)(sizeof(vec) / 4); ++l) {
        a[l] = 0.999999f;
        b[l] = 1e-7f * (omp_get_thread_num() + 1);
      }
      for (int c = 0; c < kChains; ++c) acc[c] = a * (float)c;
      for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
      }
      for (int c = 0; c < kChains; ++c) sink += acc[c][0];
    }
    const std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
    const double flops = 2.0 * threads * iters * kChains * (sizeof(vec) / 4);
    if (flops / s.count() > best) best = flops / s.count();
  }
  std::printf("%.3f %g\n", best / 1e9, sink);
  return 0;
}
"""


def fma_peak_gflops(threads: int) -> float:
    """fp32 multiply-adds per second on `threads` threads, best of 5 runs (~0.2 s each)."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("g++ not found: the FMA probe is compiled for this CPU (-march=native)")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.cpp", Path(tmp) / "fma"
        source.write_text(FMA_PROBE)
        subprocess.run(
            [
                compiler,
                "-O2",
                "-march=native",
                "-ffp-contract=fast",
                "-fopenmp",
                "-o",
                binary,
                source,
            ],
            check=True,
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([binary], check=True, capture_output=True, text=True, env=env)
    return float(out.stdout.split()[0])


@dataclass(frozen=True)
class LoadCost:
    """fp32 arithmetic of one request of the load, in FLOP (a multiply-add is 2)."""

    products: float  # the decoder layers' linear layers
    lm_head: float  # one vocabulary projection per output token
    attention: float  # q.k and p.v over each token's context
    output_tokens: int

    @property
    def per_output_token(self) -> float:
        return (self.products + self.lm_head + self.attention) / self.output_tokens


def load_cost(shape: ModelShape, prompt_len: int, output_len: int) -> LoadCost:
    """The arithmetic qpipe's engine does for one request: every prompt token and every output
    token but the last goes through every layer (the last token is never fed back); the last
    layer takes only the rows that are projected onto the vocabulary past attention (one per
    step: the last prompt token, then each decode); attention is causal."""
    layers, hidden, head_dim = shape.num_layers, shape.hidden_size, shape.head_dim
    per_layer = shape.linear_params // layers
    qkv = hidden * (shape.num_heads + 2 * shape.num_kv_heads) * head_dim
    rest = per_layer - qkv  # o_proj, gate_up, down: what the last layer skips for other rows
    fed = prompt_len + output_len - 1  # token rows through the layers
    macs = layers * qkv * fed + (layers - 1) * rest * fed + rest * output_len
    contexts = range(1, fed + 1)  # token t attends to t positions
    attention_macs = layers * 2 * shape.num_heads * head_dim * sum(contexts)
    return LoadCost(
        products=2.0 * macs,
        lm_head=2.0 * hidden * shape.vocab_size * output_len,
        attention=2.0 * attention_macs,
        output_tokens=output_len,
    )


def check_against_weights(checkpoint: Path, shape: ModelShape) -> None:
    """The count above assumes the Llama family's projections (`ModelShape.linear_params`); a
    checkpoint whose linear weights hold another number of parameters is not this model."""
    counted = 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no iterator)
                if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                    rows, cols = f.get_slice(name).get_shape()
                    counted += rows * cols
    if counted != shape.linear_params:
        raise SystemExit(
            f"{checkpoint}: its decoder layers hold {counted:,} linear weights, the config's "
            f"Llama shapes {shape.linear_params:,}; this count does not fit the model"
        )


def engine_output_tok_s(checkpoint: Path, concurrency: int) -> float:
    """qpipe's offline engine in fp32 at `concurrency`, one level of throughput.py."""
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.json"
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("throughput.py")),
                str(checkpoint),
                "--dtype",
                "float32",
                "--concurrency",
                str(concurrency),
                "--json",
                str(figures),
            ],
            check=True,
        )
        return float(json.loads(figures.read_text().splitlines()[-1])["output_tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--peer", type=float, help="a peer's fp32 output tok/s at the same load")
    parser.add_argument("--engine", action="store_true", help="run qpipe's offline engine too")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    shape = load_shape(args.checkpoint)
    check_against_weights(args.checkpoint, shape)
    cost = load_cost(shape, args.prompt_len, args.output_len)
    threads = torch.get_num_threads()
    peak = fma_peak_gflops(threads)
    ceiling = peak * 1e9 / cost.per_output_token
    per_token = cost.per_output_token / 1e9
    print(
        f"load: {args.prompt_len}-token prompts, {args.output_len} output tokens: "
        f"{per_token:.3f} GFLOP per output token (linear layers "
        f"{cost.products / cost.output_tokens / 1e9:.3f}, LM head "
        f"{cost.lm_head / cost.output_tokens / 1e9:.3f}, attention "
        f"{cost.attention / cost.output_tokens / 1e9:.3f})"
    )
    print(
        f"fp32 FMA peak on {threads} threads: {peak:.0f} GFLOP/s -> ceiling {ceiling:.0f} output "
        "tok/s (every FLOP at the peak, nothing else in a step)"
    )
    figures = []
    if args.peer:
        figures += [("peer", args.peer), ("1.5 x peer", 1.5 * args.peer)]
    if args.engine:
        figures.append(
            (
                f"qpipe offline, c={args.concurrency}",
                engine_output_tok_s(args.checkpoint, args.concurrency),
            )
        )
    for name, tok_s in figures:
        print(
            f"{name}: {tok_s:.1f} output tok/s = {tok_s / ceiling:.0%} of the ceiling "
            f"({tok_s * per_token:.0f} GFLOP/s)"
        )


if __name__ == "__main__":
    main()
