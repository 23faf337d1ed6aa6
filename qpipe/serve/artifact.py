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
                           and, for a calibrated fp8 KV cache, `...self_attn.k_scale` and
                           `...self_attn.v_scale` (fp32 [1] each)
    qpipe_artifact.json    {"format_version": 1, "dtype": ..., "linears": {layer name: kind},
                            "kv_cache": "fp8" (only with those scales)}

Fusing and unpacking at build time is what makes loading an artifact a plain read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qpipe.serve import ARTIFACT_FORMAT_VERSION as FORMAT_VERSION
from qpipe.serve.layers.attention import KVScales
from qpipe.serve.layers.linear import LINEAR_KINDS, LinearBase
from qpipe.serve.loader import read_kv_scales
from qpipe.serve.models.llama import WeightSource
from qpipe.serve.weight_files import WeightFiles

ARTIFACT_MARKER = "qpipe_artifact.json"
ARTIFACT_FIX = "rebuild the artifact (`qpipe run RECIPE` re-runs its build stage)"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip


class ArtifactWeights:
    """A `WeightSource` over a qpipe artifact, reading each tensor when it is asked for (so a
    layer packed as it is read is never held twice)."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        meta = json.loads((path / ARTIFACT_MARKER).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: artifact format_version {meta.get('format_version')} is not "
                f"{FORMAT_VERSION}; rebuild it with this qpipe (qpipe run re-runs the build stage)"
            )
        self.linears: dict[str, str] = meta["linears"]
        self.kv_cache_fp8 = meta.get("kv_cache") == "fp8"
        self.dtype = dtype
        self.device = device
        self.files = WeightFiles([path / "model.safetensors"], ARTIFACT_FIX)

    def has(self, name: str) -> bool:
        return name in self.linears

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.tensor(name).to(self.device, self.dtype)

    def kv_scales(self, attn: str, num_kv_heads: int) -> KVScales | None:
        if not self.kv_cache_fp8:
            return None
        return read_kv_scales(self.files.get, attn, num_kv_heads).to(self.device, self.dtype)

    def linear(self, name: str, parts: list[str]) -> LinearBase:
        kind = self.linears[name]
        prefix = name + "."
        state = {
            k[len(prefix) :]: self.files.tensor(k) for k in self.files.where if k.startswith(prefix)
        }
        if kind == "dense":
            state = {k: t.to(self.dtype) for k, t in state.items()}
        return LINEAR_KINDS[kind].from_state(state).prepare_for(self.dtype, self.device)


class RecordingWeights:
    """Wraps a checkpoint's `WeightSource` and keeps everything the model asked for, under the
    names it asked with: the artifact is exactly what the engine loads, nothing more."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.tensors: dict[str, torch.Tensor] = {}
        self.linears: dict[str, LinearBase] = {}
        self.kv_cache_fp8 = False

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        self.tensors[name] = self.inner.tensor(name)
        return self.tensors[name]

    def linear(self, name: str, parts: list[str]) -> LinearBase:
        self.linears[name] = self.inner.linear(name, parts)
        return self.linears[name]

    def kv_scales(self, attn: str, num_kv_heads: int) -> KVScales | None:
        scales = self.inner.kv_scales(attn, num_kv_heads)
        if scales is not None:
            self.kv_cache_fp8 = True
            for name, value in zip(("k_scale", "v_scale"), scales, strict=True):
                tensor = torch.as_tensor(value, dtype=torch.float32, device="cpu").reshape(-1)
                self.tensors[f"{attn}.{name}"] = tensor
        return scales


def write_artifact(checkpoint_dir: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Lay out `checkpoint_dir` (HF or compressed-tensors) as a qpipe artifact in `out_dir`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from qpipe.serve.loader import CheckpointWeights, QuantizationConfig, read_config_json
    from qpipe.serve.models.llama import LlamaForCausalLM

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    config = read_config_json(checkpoint_dir)
    quantization = QuantizationConfig(config.get("quantization_config"))
    checkpoint = CheckpointWeights(
        checkpoint_dir, quantization, getattr(torch, dtype), torch.device("cpu")
    )
    hf_config = AutoConfig.from_pretrained(checkpoint_dir)
    checkpoint.files.check_against(hf_config)
    weights = RecordingWeights(checkpoint)
    LlamaForCausalLM(hf_config, weights, max_positions=1)
    tensors = {name: t.contiguous() for name, t in weights.tensors.items()}
    for name, layer in weights.linears.items():
        for buffer, tensor in layer.state_dict().items():
            tensors[f"{name}.{buffer}"] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (checkpoint_dir / file).is_file():
            shutil.copy2(checkpoint_dir / file, out_dir / file)
    linears = {name: layer.kind for name, layer in weights.linears.items()}
    marker = {"format_version": FORMAT_VERSION, "dtype": dtype, "linears": linears}
    if weights.kv_cache_fp8:
        marker["kv_cache"] = "fp8"
    (out_dir / ARTIFACT_MARKER).write_text(json.dumps(marker, indent=2))
    return out_dir
