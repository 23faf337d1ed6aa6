"""Reference: NVIDIA ModelOpt's own TensorRT-LLM checkpoint for the same model and format.

Runs in a separate venv (ModelOpt's [hf] extra pins transformers < 5.15; qpipe uses 5.17):
    python modelopt_export.py CHECKPOINT_DIR OUT_DIR {fp8|int8_sq|int4_awq} [--tp N]
"""

from __future__ import annotations

import argparse
import copy

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_tensorrt_llm_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

CONFIGS = {
    "fp8": mtq.FP8_DEFAULT_CFG,
    "int8_sq": mtq.INT8_SMOOTHQUANT_CFG,
    "int4_awq": mtq.INT4_AWQ_CFG,
}
PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
    "Quantization maps floating-point weights to a small set of integer levels.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("qformat", choices=sorted(CONFIGS))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--block-size", type=int, help="int4_awq group size (default 128)")
    args = parser.parse_args()
    config = copy.deepcopy(CONFIGS[args.qformat])
    if args.block_size:  # SmolLM2's 576 features need 64: ModelOpt refuses 128 like qpipe does
        for entry in config["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                entry["cfg"]["block_sizes"] = {-1: args.block_size, "type": "static"}
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)

    def calibrate(m: torch.nn.Module) -> None:
        for prompt in PROMPTS:
            m(**tokenizer(prompt, return_tensors="pt"))

    model = mtq.quantize(model, config, forward_loop=calibrate)
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(
            model, "llama", torch.float16, export_dir=args.out, inference_tensor_parallel=args.tp
        )


if __name__ == "__main__":
    main()
