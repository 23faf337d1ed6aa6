"""The `qpipe` build target: a directory the engine loads without any conversion work.

Layout (format_version 1):

    config.json            the source checkpoint's config (quantization_config removed: the
                           weights below are already in the engine's own formats)
    tokenizer files        copied from the checkpoint (tokenizer.json, tokenizer_config.json, ...)
    model.safetensors      embeddings and norms under their HF names; every linear layer fused
                           as the engine runs it (`...self_attn.qkv_proj`, `...mlp.gate_up_proj`),
                           its buffers under `<layer>.<buffer>`:
                             dense        weight [out, in] (model dtype), bias?
                             int8_w8a8    weight int8 [out, in], weight_scale fp32 [1, out], bias?
                             weight_only  weight int8 [out, in] (unpacked int4/int8 values),
                                          weight_scale fp32 [out, groups], weight_zero_point?, bias?
    qpipe_artifact.json    {"format_version": 1, "dtype": ..., "linears": {layer name: kind}}

Fusing and unpacking at build time is what makes loading an artifact a plain read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qpipe.serve.layers.linear import LINEAR_KINDS, LinearBase

ARTIFACT_MARKER = "qpipe_artifact.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip


class ArtifactWeights:
    """A `WeightSource` over a qpipe artifact."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        from safetensors.torch import load_file

        meta = json.loads((path / ARTIFACT_MARKER).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: artifact format_version {meta.get('format_version')} is not "
                f"{FORMAT_VERSION}; rebuild it with this qpipe (qpipe run re-runs the build stage)"
            )
        self.linears: dict[str, str] = meta["linears"]
        self.dtype = dtype
        self.tensors = load_file(path / "model.safetensors")

    def has(self, name: str) -> bool:
        return name in self.linears

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.dtype)

    def linear(self, name: str, parts: list[str]) -> LinearBase:
        kind = self.linears[name]
        prefix = name + "."
        state = {k[len(prefix) :]: t for k, t in self.tensors.items() if k.startswith(prefix)}
        if kind == "dense":
            state = {k: t.to(self.dtype) for k, t in state.items()}
        return LINEAR_KINDS[kind].from_state(state)


def write_artifact(checkpoint_dir: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Lay out `checkpoint_dir` (HF or compressed-tensors) as a qpipe artifact in `out_dir`."""
    from safetensors.torch import save_file

    from qpipe.serve.loader import load_model, read_config_json

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = read_config_json(checkpoint_dir)
    model = load_model(checkpoint_dir, getattr(torch, dtype), "cpu", max_positions=1)
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            if name == "lm_head" and module.weight is model.embed_tokens:
                continue  # tied: the loader rebuilds it from the embeddings
            linears[name] = module.kind
            for buffer, tensor in module.named_buffers():
                tensors[f"{name}.{buffer}"] = tensor.contiguous()
    tensors["model.embed_tokens.weight"] = model.embed_tokens.contiguous()
    tensors["model.norm.weight"] = model.norm.weight
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = layer.input_layernorm.weight
        tensors[f"{prefix}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (checkpoint_dir / file).is_file():
            shutil.copy2(checkpoint_dir / file, out_dir / file)
    marker = {"format_version": FORMAT_VERSION, "dtype": dtype, "linears": linears}
    (out_dir / ARTIFACT_MARKER).write_text(json.dumps(marker, indent=2))
    return out_dir
