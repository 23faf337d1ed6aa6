"""Reading calibration files into raw samples, whatever their format.

Formats: JSONL (one object per line), plain text (paragraphs separated by blank lines), CSV,
Parquet, and a directory written by `datasets.save_to_disk`. Text formats are decoded strictly as
UTF-8 so a wrongly encoded file fails with its byte offset instead of calibrating on mojibake.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from qpipe.calibration.samples import CalibrationDataError, RawSample, sample_from_row

Format = Literal["jsonl", "text", "csv", "parquet", "hf-dir"]

EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_FORMAT_NAMES = "jsonl, text, csv, parquet, hf-dir"
_BOM = b"\xef\xbb\xbf"


def detect_format(path: Path, requested: str) -> Format:
    """The format to read `path` as: `requested` unless "auto", then the extension (or a dir)."""
    if not path.exists():
        raise CalibrationDataError(
            f"{path}: calibration dataset not found; fix calibration.dataset (a relative path is "
            "resolved from the recipe's directory)"
        )
    if requested == "auto":
        requested = "hf-dir" if path.is_dir() else EXTENSIONS.get(path.suffix.lower(), "auto")
    if requested == "auto":
        raise CalibrationDataError(
            f"{path}: cannot tell the format from the extension {path.suffix!r}; set "
            f"calibration.format to one of {_FORMAT_NAMES}"
        )
    if path.is_dir() != (requested == "hf-dir"):
        raise CalibrationDataError(
            f"{path}: calibration.format is {requested!r} but this is a "
            f"{'directory' if path.is_dir() else 'file'}; only hf-dir datasets are directories"
        )
    return requested  # type: ignore[return-value]


def dataset_files(path: Path) -> list[Path]:
    """Every file whose content the calibration set depends on (all files of a dataset dir)."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def read_text_file(path: Path) -> str:
    """The file as UTF-8 text; empty and non-UTF-8 files are errors that say how to fix them."""
    raw = path.read_bytes()
    start = len(_BOM) if raw.startswith(_BOM) else 0
    try:
        text = raw[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        offset = start + exc.start
        line = raw.count(b"\n", 0, offset) + 1
        raise CalibrationDataError(
            f"{path}:{line}: not UTF-8 text (byte offset {offset}: {raw[offset : offset + 1]!r}); "
            f"re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > fixed"
            f"{path.suffix}"
        ) from exc
    if not text.strip():
        raise CalibrationDataError(
            f"{path}: the file is empty; add calibration samples or point calibration.dataset "
            "at another file"
        )
    return text


def _jsonl(path: Path, field: str | None) -> Iterator[RawSample]:
    for number, line in enumerate(read_text_file(path).split("\n"), start=1):
        if not line.strip():
            continue
        origin = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationDataError(
                f"{origin}: invalid JSON ({exc.msg}: column {exc.colno}); each line must be one "
                'complete JSON object, e.g. {"text": "..."}'
            ) from exc
        if not isinstance(record, dict):
            raise CalibrationDataError(
                f"{origin}: a JSON {type(record).__name__}, expected an object such as "
                '{"text": "..."}; wrap the value in an object'
            )
        yield sample_from_row(record, origin, field)


def _text(path: Path) -> Iterator[RawSample]:
    """Paragraphs (runs of non-blank lines); each knows the line it starts on."""
    paragraph: list[str] = []
    first_line = 0
    lines = read_text_file(path).split("\n")
    for number, line in enumerate([*lines, ""], start=1):
        if line.strip():
            if not paragraph:
                first_line = number
            paragraph.append(line.rstrip("\r"))
        elif paragraph:
            yield RawSample(origin=f"{path}:{first_line}", text="\n".join(paragraph).strip())
            paragraph = []


def _csv(path: Path, field: str | None) -> Iterator[RawSample]:
    reader = csv.DictReader(io.StringIO(read_text_file(path), newline=""))
    try:
        reader.fieldnames  # noqa: B018 (reads the header, so line_num points past it)
        record_start = reader.line_num + 1
        for row in reader:
            origin = f"{path}:{record_start}"
            record_start = reader.line_num + 1
            if None in row:
                raise CalibrationDataError(
                    f"{origin}: more values than the {len(reader.fieldnames or ())} header "
                    "columns; quote values that contain commas"
                )
            yield sample_from_row(row, origin, field)
    except csv.Error as exc:
        raise CalibrationDataError(
            f"{path}:{reader.line_num}: not valid CSV ({exc}); check the quoting on that line"
        ) from exc


def _rows(rows: Any, origin_prefix: str, field: str | None) -> Iterator[RawSample]:
    count = 0
    for index, row in enumerate(rows, start=1):
        count += 1
        yield sample_from_row(row, f"{origin_prefix} row {index}", field)
    if count == 0:
        raise CalibrationDataError(
            f"{origin_prefix}: the dataset has no rows; point calibration.dataset at data"
        )


def _parquet(path: Path, field: str | None) -> Iterator[RawSample]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CalibrationDataError(
            f"{path}: not a readable Parquet file ({exc}); check calibration.format"
        ) from exc
    yield from _rows(table.to_pylist(), str(path), field)


def _hf_dir(path: Path, field: str | None, split: str | None) -> Iterator[RawSample]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise CalibrationDataError(
            f"{path}: not a directory written by datasets' save_to_disk ({exc}); point "
            "calibration.dataset at one, or at a file"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None and len(names) == 1:
            split = names[0]
        if split not in loaded:
            raise CalibrationDataError(
                f"{path}: the saved dataset has splits {', '.join(names)}; set calibration.split "
                "to the one to calibrate on"
            )
        loaded = loaded[split]
    prefix = f"{path}[{split}]" if split else str(path)
    yield from _rows(loaded, prefix, field)


def read_samples(
    path: Path, fmt: Format, field: str | None = None, split: str | None = None
) -> list[RawSample]:
    """All samples of the dataset, in file order."""
    if fmt == "jsonl":
        samples = list(_jsonl(path, field))
    elif fmt == "text":
        if field is not None:
            raise CalibrationDataError(
                f"{path}: calibration.field does not apply to plain text; remove it"
            )
        samples = list(_text(path))
    elif fmt == "csv":
        samples = list(_csv(path, field))
    elif fmt == "parquet":
        samples = list(_parquet(path, field))
    else:
        samples = list(_hf_dir(path, field, split))
    if not samples:
        raise CalibrationDataError(
            f"{path}: the file holds no samples; add calibration samples to it"
        )
    return samples
