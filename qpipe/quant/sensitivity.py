"""Which decoder blocks hurt most when quantized, and the fewest to keep 16-bit for a KLD budget.

Each block is fake-quantized alone (round-to-nearest of the method's scheme; see fake_quant.py for
why a proxy) and scored by the KL divergence it adds against the 16-bit model on held-out text.
auto_keep_16bit then keeps the most sensitive blocks in 16-bit, as few as meet the budget with every
other block quantized (blocks interact, so that is measured, not summed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qpipe.quant.config import QuantizationConfig
from qpipe.quant.divergence import compare, perplexity
from qpipe.quant.fake_quant import fake_quantized
from qpipe.quant.group_size import matches_any

if TYPE_CHECKING:
    import torch
    from compressed_tensors.quantization import QuantizationScheme

_BLOCK_LINEAR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class BlockSensitivity:
    block: int
    kld: float
    """KL divergence (nats/token) vs 16-bit with only this block quantized."""
    top1_agreement: float


@dataclass(frozen=True)
class KeepDecision:
    """The blocks auto_keep_16bit left in 16-bit, and the measurements that chose them."""

    max_kld: float
    blocks: list[int]
    proxy_kld: float
    met_budget: bool
    trials: dict[int, float] = field(default_factory=dict)
    """Whole-model proxy KLD with the top-k most sensitive blocks kept 16-bit, by k."""

    @property
    def keep_patterns(self) -> list[str]:
        return [rf"re:.*layers\.{b}\..*" for b in sorted(self.blocks)]

    def reason(self) -> str:
        if not self.blocks:
            return f"all blocks quantized: proxy KLD {self.proxy_kld:.4f} <= {self.max_kld}"
        verdict = "<=" if self.met_budget else "still >"
        return (
            f"kept {len(self.blocks)} most sensitive block(s) {sorted(self.blocks)} in 16-bit: "
            f"proxy KLD {self.trials[0]:.4f} -> {self.proxy_kld:.4f} {verdict} {self.max_kld}"
        )


@dataclass(frozen=True)
class SensitivityReport:
    method: str
    baseline_perplexity: float
    all_blocks_kld: float
    blocks: list[BlockSensitivity]
    """Most sensitive first."""
    windows: int
    seq_len: int
    proxy: str = "round-to-nearest of the method's scheme, one block at a time"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"Sensitivity ({self.method}, {self.proxy}); {self.windows} x {self.seq_len} tokens; "
            f"16-bit perplexity {self.baseline_perplexity:.3f}; all blocks quantized: KLD "
            f"{self.all_blocks_kld:.4f}",
            "",
            "| rank | block | KLD added | top-1 agreement |",
            "|---:|---:|---:|---:|",
        ]
        for rank, b in enumerate(self.blocks, 1):
            lines.append(f"| {rank} | {b.block} | {b.kld:.5f} | {b.top1_agreement:.3f} |")
        return "\n".join(lines) + "\n"


def block_linears(model: torch.nn.Module, keep_16bit: list[str]) -> dict[int, list[str]]:
    """Quantizable linear names per decoder block (what keep_16bit leaves out is not counted)."""
    import torch

    blocks: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        match = _BLOCK_LINEAR.match(name)
        if match and isinstance(module, torch.nn.Linear) and not matches_any(name, keep_16bit):
            blocks.setdefault(int(match.group(1)), []).append(name)
    return dict(sorted(blocks.items()))


def rank_blocks(
    model: torch.nn.Module,
    scheme: QuantizationScheme,
    windows: torch.Tensor,
    reference: torch.Tensor,
    blocks: dict[int, list[str]],
    progress: Progress | None = None,
) -> list[BlockSensitivity]:
    scores = []
    for done, (block, names) in enumerate(blocks.items()):
        with fake_quantized(model, names, scheme):
            divergence = compare(reference, model, windows)
        scores.append(BlockSensitivity(block, divergence.kld, divergence.top1_agreement))
        if progress:
            progress("block sensitivity", done + 1, len(blocks))
    return sorted(scores, key=lambda s: s.kld, reverse=True)


def choose_blocks_to_keep(
    model: torch.nn.Module,
    scheme: QuantizationScheme,
    windows: torch.Tensor,
    reference: torch.Tensor,
    blocks: dict[int, list[str]],
    ranked: list[BlockSensitivity],
    max_kld: float,
) -> KeepDecision:
    """The smallest k such that keeping the top-k blocks 16-bit meets max_kld (binary search).

    Assumes keeping more blocks never raises the KLD, which holds up to measurement noise.
    """
    order = [s.block for s in ranked]
    trials: dict[int, float] = {}

    def kld_keeping(k: int) -> float:
        if k not in trials:
            kept = set(order[:k])
            names = [n for b, ns in blocks.items() if b not in kept for n in ns]
            if not names:
                return 0.0  # nothing quantized: identical to the reference
            with fake_quantized(model, names, scheme):
                trials[k] = compare(reference, model, windows).kld
        return trials[k]

    low, high = 0, len(order)
    if kld_keeping(0) > max_kld:
        while high - low > 1:
            mid = (low + high) // 2
            if kld_keeping(mid) <= max_kld:
                high = mid
            else:
                low = mid
        best = high
    else:
        best = 0
    return KeepDecision(
        max_kld=max_kld,
        blocks=order[:best],
        proxy_kld=kld_keeping(best),
        met_budget=kld_keeping(best) <= max_kld,
        trials=dict(sorted(trials.items())),
    )


def plot(report: SensitivityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_block = sorted(report.blocks, key=lambda b: b.block)
    fig, ax = plt.subplots(figsize=(max(6, len(by_block) * 0.3), 3.5))
    ax.bar([str(b.block) for b in by_block], [b.kld for b in by_block], color="tab:orange")
    ax.set_xlabel("decoder block (quantized alone)")
    ax.set_ylabel("KL divergence vs 16-bit (nats/token)")
    ax.set_title(f"{report.method}: per-block sensitivity (RTN proxy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sensitivity(
    checkpoint_dir: Path,
    calibration_file: Path | None,
    quant_config: QuantizationConfig,
    text_file: Path | None,
    out_dir: Path,
    num_windows: int = 8,
    seq_len: int = 256,
    progress: Progress | None = None,
) -> SensitivityReport:
    """Rank decoder blocks; write sensitivity.json, sensitivity.md and sensitivity.png to out_dir.

    Held-out windows come from `text_file` (preferred) or else the calibration set.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpipe.quant.divergence import heldout_windows, log_probs, read_texts
    from qpipe.quant.divergence import windows_from_calibration as calibration_windows
    from qpipe.quant.schemes import quantization_scheme

    if quant_config.method == "none":
        raise ValueError("sensitivity needs a quantization method; the recipe says 'none'")
    if text_file is not None:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        windows = heldout_windows(tokenizer, read_texts(text_file), num_windows, seq_len)
    elif calibration_file is not None:
        windows = calibration_windows(calibration_file, num_windows)
    else:
        raise ValueError("sensitivity needs held-out text (--text) or a calibration set")
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype="auto").eval()
    reference = log_probs(model, windows)
    scheme = quantization_scheme(quant_config)
    blocks = block_linears(model, quant_config.keep_16bit)
    with fake_quantized(model, [n for ns in blocks.values() for n in ns], scheme):
        all_blocks = compare(reference, model, windows).kld
    report = SensitivityReport(
        method=quant_config.method,
        baseline_perplexity=perplexity(reference, windows),
        all_blocks_kld=all_blocks,
        blocks=rank_blocks(model, scheme, windows, reference, blocks, progress),
        windows=int(windows.shape[0]),
        seq_len=int(windows.shape[1]),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sensitivity.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (out_dir / "sensitivity.md").write_text(report.table())
    plot(report, out_dir / "sensitivity.png")
    return report
