"""Which samples calibrate: deduplicated, in a seeded random order, within the length limits.

Samples are tokenized lazily in that order and only until enough are kept, so a large dataset costs
the tokenization of what is used, and the same seed always picks the same samples.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qpipe.calibration.render import RenderedSample
from qpipe.calibration.samples import CalibrationDataError
from qpipe.quant.config import CalibrationConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BATCH = 256


@dataclass(frozen=True)
class KeptSample:
    origin: str
    token_ids: tuple[int, ...]
    templated: bool


@dataclass(frozen=True)
class Selection:
    """The kept samples in order, and what happened to every sample read."""

    kept: tuple[KeptSample, ...]
    samples_read: int
    duplicates: int
    empty: int
    examined: int
    too_short: int
    too_long: int

    @property
    def unused(self) -> int:
        """Usable-looking samples never tokenized because enough were kept before them."""
        return self.samples_read - self.duplicates - self.empty - self.examined


def packed_ids(token_ids: tuple[int, ...], eos_id: int | None) -> tuple[int, ...]:
    """A sample as it goes into a packed stream: ended by EOS so documents stay apart."""
    if eos_id is None or (token_ids and token_ids[-1] == eos_id):
        return token_ids
    return (*token_ids, eos_id)


def _unique(
    samples: list[RenderedSample], deduplicate: bool
) -> tuple[list[RenderedSample], int, int]:
    """Drop empty samples and exact duplicates (after whitespace normalisation), first one wins."""
    seen: set[str] = set()
    unique, duplicates, empty = [], 0, 0
    for sample in samples:
        normalised = " ".join(sample.text.split())
        if not normalised:
            empty += 1
        elif deduplicate and normalised in seen:
            duplicates += 1
        else:
            seen.add(normalised)
            unique.append(sample)
    return unique, duplicates, empty


def _tokenized(
    ordered: list[RenderedSample], tokenizer: PreTrainedTokenizerBase
) -> Iterator[tuple[RenderedSample, tuple[int, ...]]]:
    for start in range(0, len(ordered), _BATCH):
        batch = ordered[start : start + _BATCH]
        ids: dict[int, list[int]] = {}
        for templated in (True, False):
            positions = [i for i, s in enumerate(batch) if s.templated == templated]
            if positions:
                encoded = tokenizer(
                    [batch[i].text for i in positions], add_special_tokens=not templated
                )["input_ids"]
                ids.update(zip(positions, encoded, strict=True))
        for index, sample in enumerate(batch):
            yield sample, tuple(ids[index])


def _shortfall(source: str, config: CalibrationConfig, counts: Selection, tokens: int) -> str:
    why = (
        f"of {counts.samples_read} read, {counts.duplicates} were duplicates, {counts.empty} "
        f"empty, {counts.too_short} shorter than min_tokens={config.min_tokens}"
    )
    if config.max_tokens is not None:
        why += f", {counts.too_long} longer than max_tokens={config.max_tokens}"
    usable = len(counts.kept)
    if usable == 0:  # NOTE: no lower num_samples helps: it must be at least 1
        return f"{source}: no sample is usable ({why}); add data"
    if config.packing:
        rows = tokens // config.seq_len
        lower = f"num_samples to {rows} or seq_len" if rows else "seq_len"
        return (
            f"{source}: the {usable} usable samples hold {tokens} tokens, enough for {rows} packed "
            f"rows of seq_len={config.seq_len}, but calibration.num_samples asks for "
            f"{config.num_samples} ({why}); lower {lower}, or add data"
        )
    return (
        f"{source}: only {usable} usable samples, calibration.num_samples asks for "
        f"{config.num_samples} ({why}); lower num_samples to {usable} or add data"
    )


def select(
    samples: list[RenderedSample],
    tokenizer: PreTrainedTokenizerBase,
    config: CalibrationConfig,
    source: str,
    show_progress: bool = True,
) -> Selection:
    ordered, duplicates, empty = _unique(samples, config.deduplicate)
    random.Random(config.seed).shuffle(ordered)
    eos_id = tokenizer.eos_token_id
    needed = config.num_samples * config.seq_len if config.packing else config.num_samples
    kept: list[KeptSample] = []
    have = examined = too_short = too_long = tokens = 0
    with Progress(
        TextColumn("[bold]calibration set"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens" if config.packing else "samples"),
        TimeElapsedColumn(),
        disable=not show_progress,
    ) as progress:
        task = progress.add_task("select", total=needed)
        for sample, token_ids in _tokenized(ordered, tokenizer):
            if have >= needed:
                break
            examined += 1
            if len(token_ids) < config.min_tokens:
                too_short += 1
                continue
            if config.max_tokens is not None and len(token_ids) > config.max_tokens:
                too_long += 1
                continue
            kept.append(KeptSample(sample.origin, token_ids, sample.templated))
            tokens += len(packed_ids(token_ids, eos_id))
            have = tokens if config.packing else len(kept)
            progress.update(task, completed=min(have, needed))
    selection = Selection(
        kept=tuple(kept),
        samples_read=len(samples),
        duplicates=duplicates,
        empty=empty,
        examined=examined,
        too_short=too_short,
        too_long=too_long,
    )
    if have < needed:
        raise CalibrationDataError(_shortfall(source, config, selection, tokens))
    return selection
