"""The whole calibration flow: read -> render -> select -> tokenize into windows -> stats."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qpipe.calibration.readers import dataset_files, detect_format, read_samples
from qpipe.calibration.render import render
from qpipe.calibration.selection import select
from qpipe.calibration.stats import (
    STATS_NAME,
    CalibrationStats,
    DropCounts,
    TokenCounts,
    histogram,
    length_summary,
)
from qpipe.calibration.token_set import TokenSet, one_per_row, packed
from qpipe.quant.config import CalibrationConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class CalibrationSet:
    tokens: TokenSet
    stats: CalibrationStats

    def save(self, out_dir: Path) -> None:
        self.tokens.save(out_dir)
        (out_dir / STATS_NAME).write_text(self.stats.model_dump_json(indent=2) + "\n")


def build_calibration_set(
    config: CalibrationConfig,
    dataset: Path,
    tokenizer: PreTrainedTokenizerBase,
    show_progress: bool = True,
) -> CalibrationSet:
    fmt = detect_format(dataset, config.format)
    raw = read_samples(dataset, fmt, config.field, config.split)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_template = config.apply_chat_template and has_template
    rendered = [render(sample, tokenizer, use_template) for sample in raw]
    selection = select(rendered, tokenizer, config, str(dataset), show_progress)

    eos_id = tokenizer.eos_token_id
    pad_id = next((i for i in (tokenizer.pad_token_id, eos_id) if i is not None), 0)
    left_over = 0
    if config.packing:
        tokens, left_over = packed(selection.kept, config.seq_len, config.num_samples, eos_id)
    else:
        tokens = one_per_row(selection.kept, config.seq_len, pad_id)

    lengths = [len(sample.token_ids) for sample in selection.kept]
    cut = [n - config.seq_len for n in lengths if n > config.seq_len] if not config.packing else []
    in_rows = int(tokens.attention_mask.sum())
    notes = []
    if any(s.messages is not None for s in raw) and not use_template:
        why = "apply_chat_template is off" if has_template else "the tokenizer has no chat template"
        notes.append(f"conversations joined as plain text: {why}")
    files = dataset_files(dataset)
    stats = CalibrationStats(
        dataset=str(dataset),
        format=fmt,
        files=[str(f.relative_to(dataset)) if dataset.is_dir() else f.name for f in files],
        num_samples=config.num_samples,
        seq_len=config.seq_len,
        seed=config.seed,
        packing=config.packing,
        samples_read=selection.samples_read,
        examined=selection.examined,
        kept=len(selection.kept),
        unused=selection.unused,
        dropped=DropCounts(
            duplicate=selection.duplicates,
            empty=selection.empty,
            too_short=selection.too_short,
            too_long=selection.too_long,
        ),
        truncated=len(cut),
        chat_template_applied=sum(sample.templated for sample in selection.kept),
        rows=int(tokens.input_ids.shape[0]),
        tokens=TokenCounts(
            in_kept_samples=sum(lengths),
            in_rows=in_rows,
            padding=int(tokens.attention_mask.size) - in_rows,
            truncated_away=sum(cut),
            packing_left_over=left_over,
        ),
        sample_tokens=length_summary(lengths),
        histogram=histogram(lengths),
        pad_token_id=pad_id,
        content_hash=tokens.content_hash,
        notes=notes,
    )
    return CalibrationSet(tokens, stats)
