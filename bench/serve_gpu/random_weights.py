"""A checkpoint with a real model's shapes and tokenizer but random weights, for speed figures
where the weights cannot travel: the lent GPU machine takes at most 64 MiB of files and reaches no
model hub, and SmolLM2's smallest GGUF is 98 MB. Compute and memory traffic per token depend only
on the shapes, so throughput measured on it is the real model's; its text is noise.

    python3 bench/serve_gpu/random_weights.py SHAPE_DIR OUT_DIR [--dtype bfloat16]

SHAPE_DIR holds config.json and the tokenizer files (bench/serve_gpu/prepare.sh copies them).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.shape)
    # NOTE: `.to()` rather than from_config's dtype keyword, whose name changed across versions
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in args.shape.iterdir():
        if f.name != "config.json" and not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
