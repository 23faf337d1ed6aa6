"""The engine's host-side work per decode step and per running sequence: scheduling, the model
runner's inputs and sampling bookkeeping, postprocessing and outputs, on a model so small that its
forward costs next to nothing. Not a test: timings depend on the machine.

    .venv/bin/python bench/serve_engine/host_overhead.py TOKENIZER_DIR [--concurrency 1 64 256]

Why: on a GPU a decode step's kernels run in a CUDA graph in a few milliseconds, and everything
the host does between two replays adds to it, per sequence. On the H200 (twenty-ninth session) a
SmolLM2 step grew 22 us per added sequence, which at concurrency 256 would be ~5.6 ms of a step;
this measures the Python part of that on CPU, where it can be changed and checked. The server
also detokenizes every new token on the engine thread between two steps (`detokenize`, with the
served path's `IncrementalDetokenizer`).

TOKENIZER_DIR is any checkpoint (its tokenizer is reused); the model is a 1-layer Llama of hidden
size 64 and a 4,096-token vocabulary with random weights, written to a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from qpipe.serve import model_runner
from qpipe.serve.config import EngineConfig
from qpipe.serve.detokenizer import IncrementalDetokenizer
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams

VOCAB = 4096


def micro_model(tokenizer_dir: Path, out: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


class Timers:
    """Wall time spent inside chosen methods, per name, while `on`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.on = False

    def wrap(self, owner: object, method: str, name: str) -> None:
        inner: Callable[..., object] = getattr(owner, method)

        def timed(*args: object, **kwargs: object) -> object:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=20, help="decode steps per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows per level; the best counts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = micro_model(args.tokenizer, Path(tmp) / "micro")
        top = max(args.concurrency)
        engine = LLMEngine(
            EngineConfig(
                model=str(model),
                device="cpu",
                num_kv_blocks=top * 8,
                max_num_seqs=top,
                max_num_batched_tokens=max(top * 16, 2048),
            )
        )
        timers = Timers()
        timers.wrap(engine.scheduler, "schedule", "schedule")
        timers.wrap(engine.scheduler, "postprocess", "postprocess")
        timers.wrap(engine.model_runner.model, "final_hidden", "forward")
        timers.wrap(engine.model_runner.model, "compute_logits", "forward")
        timers.wrap(model_runner, "sample", "sample")
        timers.wrap(IncrementalDetokenizer, "add_tokens", "detokenize")
        gen = torch.Generator().manual_seed(0)
        # sampling's argmax over the vocabulary is compute here, a few microseconds on a GPU
        print("concurrency | step us | forward us | host us | host but sample us / seq | parts")
        for concurrency in args.concurrency:
            params = SamplingParams(
                max_tokens=args.steps * args.repeats + 4, temperature=0, ignore_eos=True
            )
            detokenizers = {}
            for i in range(concurrency):
                prompt = torch.randint(100, VOCAB, (16,), generator=gen).tolist()
                request_id = f"{concurrency}-{i}"
                engine.add_request(request_id, prompt, params)
                detokenizers[request_id] = IncrementalDetokenizer(engine.tokenizer, prompt)
            engine.step()  # the prefills
            engine.step()
            windows = []  # a shared VM's noise only ever adds: the quietest window counts
            for _ in range(args.repeats):
                timers.spent.clear()
                timers.on = True
                start = time.perf_counter()
                for _ in range(args.steps):
                    for output in engine.step():
                        detokenizers[output.request_id].add_tokens(output.new_token_ids)
                elapsed = time.perf_counter() - start
                timers.on = False
                windows.append((elapsed, dict(timers.spent)))
            while engine.has_unfinished():
                engine.step()
            elapsed, spent = min(windows, key=lambda w: w[0] - sum(w[1].values()))
            per_step = {name: us / args.steps * 1e6 for name, us in spent.items()}
            step = elapsed / args.steps * 1e6
            host = step - per_step["forward"]
            python = (host - per_step["sample"]) / concurrency
            parts = ", ".join(
                f"{name} {us:.0f}" for name, us in per_step.items() if name != "forward"
            )
            print(
                f"{concurrency:11d} | {step:7.0f} | {per_step['forward']:10.0f} | {host:7.0f} | "
                f"{python:24.1f} | {parts}"
            )


if __name__ == "__main__":
    main()
