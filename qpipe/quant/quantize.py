"""Quantize a 16-bit HF checkpoint with llm-compressor and save it in compressed-tensors format.

This module only adapts qpipe's inputs (a checkpoint directory, a tokenized calibration set, a
validated QuantizationConfig) to llm-compressor's `oneshot` and records what happened; the
algorithms are llm-compressor's.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qpipe.quant.compat import cpu_safe_pinning
from qpipe.quant.config import QuantizationConfig
from qpipe.quant.divergence import Divergence, compare, log_probs, perplexity
from qpipe.quant.group_size import check_group_size
from qpipe.quant.schemes import modifiers, quantization_scheme
from qpipe.quant.sensitivity import (
    KeepDecision,
    Progress,
    block_linears,
    choose_blocks_to_keep,
    rank_blocks,
)

if TYPE_CHECKING:
    import torch
    from datasets import Dataset

TOOLS = ("torch", "transformers", "llmcompressor", "compressed-tensors")
# Files that travel with the weights; tokenizer files are rewritten by the tokenizer itself.
SIDE_FILES = ("generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Probe:
    """The quantized model vs the 16-bit one on a few windows, measured in memory before saving."""

    windows: int
    seq_len: int
    baseline_perplexity: float
    divergence: Divergence


@dataclass(frozen=True)
class QuantizeOutcome:
    """What a quantization run did, for qpipe_quant.json and the stage metrics."""

    method: str
    parameters: dict[str, Any]
    kv_cache: str
    keep_16bit: list[str]
    layers_16bit: set[str]
    quantized_layers: int
    wall_s: float
    peak_rss_mib: float
    tool_versions: dict[str, str]
    probe: Probe | None = None
    auto_keep: KeepDecision | None = None
    notes: list[str] = field(default_factory=list)


def tool_versions() -> dict[str, str]:
    versions = {}
    for name in TOOLS:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def reset_peak_rss() -> None:
    """Start a fresh peak-RSS window (Linux clear_refs); elsewhere the peak is the process's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def calibration_dataset(calibration_file: Path) -> Dataset:
    """The calibrate stage's token windows as a datasets.Dataset, padding stripped per row.

    Rows keep their own length (llm-compressor runs batch size 1), so padding never enters the
    activation statistics.
    """
    from datasets import Dataset
    from safetensors.torch import load_file

    tensors = load_file(str(calibration_file))
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    rows = [row for row in rows if row]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def quantized_linear_names(model: Any) -> set[str]:
    """Linear layers whose weights were quantized (a quantized KV cache alone leaves a scheme
    without weights on every layer, and one on the attention modules)."""
    import torch

    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and getattr(getattr(module, "quantization_scheme", None), "weights", None) is not None
    }


def quantize_checkpoint(
    checkpoint: Path,
    quant: QuantizationConfig,
    out_dir: Path,
    calibration_file: Path | None = None,
    probe_windows: torch.Tensor | None = None,
    progress: Progress | None = None,
) -> QuantizeOutcome:
    """Quantize `checkpoint` into `out_dir` (weights, config, tokenizer, generation config).

    With `probe_windows`, the 16-bit and quantized models are compared on them (in memory, before
    saving), and auto_keep_16bit measures its block choice on them.
    """
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_group_size(checkpoint, quant)
    if quant.method_calibrates and calibration_file is None:
        raise ValueError(f"{quant.label} needs a calibration set; none was given")
    if quant.auto_keep_16bit is not None and probe_windows is None:
        raise ValueError("auto_keep_16bit needs held-out windows to measure on")
    reset_peak_rss()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = log_probs(model, probe_windows) if probe_windows is not None else None
    keep, decision = list(quant.keep_16bit), None
    if quant.auto_keep_16bit is not None:
        decision = _choose_blocks(model, quant, probe_windows, reference, progress)
        keep += decision.keep_patterns
    notes = []
    with cpu_safe_pinning() as patched:
        if patched and quant.method == "awq":
            notes.append("AWQ ran with IntermediatesCache pinning skipped (no accelerator)")
        dataset = calibration_dataset(calibration_file) if quant.method_calibrates else None
        oneshot(
            model=model,
            tokenizer=tokenizer,
            recipe=modifiers(quant, keep),
            dataset=dataset,
            num_calibration_samples=len(dataset) if dataset is not None else 0,
            shuffle_calibration_samples=False,
        )
    quantized = quantized_linear_names(model)
    probe = None
    if reference is not None:
        probe = Probe(
            windows=int(probe_windows.shape[0]),
            seq_len=int(probe_windows.shape[1]),
            baseline_perplexity=perplexity(reference, probe_windows),
            divergence=compare(reference, model, probe_windows),
        )
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
    for name in SIDE_FILES:
        if (checkpoint / name).exists() and not (out_dir / name).exists():
            shutil.copy2(checkpoint / name, out_dir / name)
    return QuantizeOutcome(
        method=quant.method,
        parameters=quant.parameters,
        kv_cache=quant.kv_cache,
        keep_16bit=keep,
        layers_16bit=_linears(model) - quantized,
        quantized_layers=len(quantized),
        wall_s=round(time.perf_counter() - start, 2),
        peak_rss_mib=round(peak_rss_mib(), 1),
        tool_versions=tool_versions(),
        probe=probe,
        auto_keep=decision,
        notes=notes,
    )


def _linears(model: Any) -> set[str]:
    import torch

    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _choose_blocks(
    model: Any,
    quant: QuantizationConfig,
    windows: torch.Tensor,
    reference: torch.Tensor,
    progress: Progress | None,
) -> KeepDecision:
    scheme = quantization_scheme(quant)
    blocks = block_linears(model, quant.keep_16bit)
    ranked = rank_blocks(model, scheme, windows, reference, blocks, progress)
    return choose_blocks_to_keep(
        model, scheme, windows, reference, blocks, ranked, quant.auto_keep_16bit.max_kld
    )
