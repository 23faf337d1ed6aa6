"""A checkpoint with a real model's shapes and tokenizer but random weights, for speed figures
where the weights cannot travel: the lent GPU machine takes at most 64 MiB of files and reaches no
model hub, and SmolLM2's smallest GGUF is 98 MB. Compute and memory traffic per token depend only
on the shapes, so throughput measured on it is the real model's; its text is noise.

    python3 bench/serve_gpu/random_weights.py SHAPE_DIR OUT_DIR [--dtype bfloat16] [--fp8]

SHAPE_DIR holds config.json and the tokenizer files (bench/serve_gpu/prepare.sh copies them).
`--fp8` stores the linear layers (not the LM head) as llm-compressor's FP8_DYNAMIC does: fp8 e4m3
weights with per-channel scales, fp8 activations per token, compressed-tensors' config.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

FP8_DYNAMIC = {  # the parts of compressed-tensors' config that qpipe's loader reads
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "float-quantized",
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
            },
        }
    },
}  # fmt: skip


def to_fp8_dynamic(model: torch.nn.Module, out: Path) -> None:
    """Rewrites the saved weights in `out` as FP8_DYNAMIC: absmax / 448 per output channel."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            weight = module.weight.detach().float()
            scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            tensors[f"{name}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[f"{name}.weight_scale"] = scale.to(torch.bfloat16)
    for name, tensor in model.state_dict().items():
        tensors.setdefault(name, tensor.contiguous())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for old in out.glob("*.safetensors*"):
        old.unlink()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = FP8_DYNAMIC
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--fp8", action="store_true", help="linear layers as FP8_DYNAMIC")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.shape)
    # NOTE: `.to()` rather than from_config's dtype keyword, whose name changed across versions
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if args.fp8:
        to_fp8_dynamic(model, tmp)
    for f in args.shape.iterdir():
        if f.name != "config.json" and not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
