"""qpipe's side of the reference comparison: llm-compressor quantization in the scheme closest to
ModelOpt's format, then qpipe's TensorRT-LLM checkpoint writer.

    .venv/bin/python bench/trtllm_reference/qpipe_export.py CKPT OUT {fp8|int8_sq|int4_awq} [--tp N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

from qpipe.export.trtllm_checkpoint import write_trtllm_checkpoint

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
    "Quantization maps floating-point weights to a small set of integer levels.",
]


def scheme(qformat: str) -> QuantizationScheme:
    if qformat == "fp8":
        weights = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
        acts = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    elif qformat == "int8_sq":
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", strategy="tensor", dynamic=False)
    else:
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=64)
        acts = None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("qformat", choices=["fp8", "int8_sq", "int4_awq"])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    rows = [tokenizer(p).input_ids for p in PROMPTS]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    quant = scheme(args.qformat)
    oneshot(
        model=model, tokenizer=tokenizer, shuffle_calibration_samples=False,
        recipe=QuantizationModifier(config_groups={"g": quant}, ignore=["lm_head"]),
        dataset=data if quant.input_activations else None,
        num_calibration_samples=len(rows) if quant.input_activations else 0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        write_trtllm_checkpoint(Path(tmp), Path(args.out), tp=args.tp, dtype="float16")


if __name__ == "__main__":
    main()
