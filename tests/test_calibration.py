"""Calibration data: each format, selection, tokenization, each bad-data error (real tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qpipe.calibration.builder import CalibrationSet, build_calibration_set
from qpipe.calibration.readers import dataset_files, detect_format, read_samples
from qpipe.calibration.samples import CalibrationDataError
from qpipe.quant.config import CalibrationConfig

CHAT_MARKERS = ("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def sentences(count: int, words: int = 12) -> list[str]:
    """Distinct sentences, each about `words` tokens long."""
    return [
        f"Sample {i} says " + " ".join(f"word{i}x{j}" for j in range(words)) for i in range(count)
    ]


def build(tokenizer: Any, dataset: Path, **fields: Any) -> CalibrationSet:
    config = CalibrationConfig(dataset=str(dataset), **fields)
    return build_calibration_set(config, dataset, tokenizer, show_progress=False)


def row_text(tokenizer: Any, calibration_set: CalibrationSet, row: int) -> str:
    ids = calibration_set.tokens.input_ids[row]
    return tokenizer.decode(ids[calibration_set.tokens.attention_mask[row] == 1])


# --- formats -------------------------------------------------------------------------------------


def test_jsonl_text_rows_hold_exactly_the_tokenized_samples(tokenizer: Any, tmp_path: Path) -> None:
    texts = sentences(3)
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    result = build(tokenizer, dataset, num_samples=3, seq_len=64, min_tokens=1)
    rows = {row_text(tokenizer, result, r) for r in range(3)}
    assert rows == set(texts)
    expected = sorted(len(tokenizer(t)["input_ids"]) for t in texts)
    assert sorted(result.tokens.attention_mask.sum(axis=1).tolist()) == expected
    assert result.stats.format == "jsonl" and result.stats.chat_template_applied == 0


def test_messages_are_rendered_with_the_chat_template(tokenizer: Any, tmp_path: Path) -> None:
    conversations = [
        {"messages": [{"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": f"Answer number {i}."}]}
        for i in range(4)
    ]  # fmt: skip
    dataset = write_jsonl(tmp_path / "chat.jsonl", conversations)
    result = build(tokenizer, dataset, num_samples=4, seq_len=96)
    assert result.stats.chat_template_applied == 4
    for row in range(4):
        text = row_text(tokenizer, result, row)
        assert all(marker in text for marker in CHAT_MARKERS)
        assert "Answer number" in text

    plain = build(tokenizer, dataset, num_samples=4, seq_len=96, apply_chat_template=False)
    assert plain.stats.chat_template_applied == 0
    assert not any(m in row_text(tokenizer, plain, 0) for m in CHAT_MARKERS)
    assert plain.stats.notes == ["conversations joined as plain text: apply_chat_template is off"]


def test_prompt_completion_pairs_chat_or_concatenated(tokenizer: Any, tmp_path: Path) -> None:
    pairs = [
        {"prompt": f"Name fruit {i}.", "completion": f"Fruit {i} is a mango."} for i in range(2)
    ]
    dataset = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    chat = build(tokenizer, dataset, num_samples=2, seq_len=64)
    text = row_text(tokenizer, chat, 0)
    assert "<|im_start|>user\nName fruit" in text and "<|im_start|>assistant\nFruit" in text
    plain = build(tokenizer, dataset, num_samples=2, seq_len=64, apply_chat_template=False)
    texts = {row_text(tokenizer, plain, r) for r in range(2)}
    assert texts == {f"Name fruit {i}.\nFruit {i} is a mango." for i in range(2)}


def test_plain_text_is_split_on_blank_lines(tokenizer: Any, tmp_path: Path) -> None:
    dataset = tmp_path / "notes.txt"
    dataset.write_text("First paragraph line one\nline two.\n\n  \nSecond one.\n\n\nThird one.\n")
    samples = read_samples(dataset, detect_format(dataset, "auto"))
    assert [s.text for s in samples] == ["First paragraph line one\nline two.", "Second one.",
                                         "Third one."]  # fmt: skip
    assert [s.origin for s in samples] == [f"{dataset}:1", f"{dataset}:5", f"{dataset}:8"]
    result = build(tokenizer, dataset, num_samples=3, seq_len=16, min_tokens=1)
    assert result.stats.samples_read == 3 and result.stats.format == "text"


def test_csv_with_quoted_multiline_field_and_line_numbers(tokenizer: Any, tmp_path: Path) -> None:
    dataset = tmp_path / "d.csv"
    dataset.write_text('id,body\n1,"one line"\n2,"two\nlines"\n3,"three"\n', encoding="utf-8")
    samples = read_samples(dataset, "csv", field="body")
    assert [s.text for s in samples] == ["one line", "two\nlines", "three"]
    assert [s.origin.rsplit(":", 1)[1] for s in samples] == ["2", "3", "5"]
    result = build(tokenizer, dataset, num_samples=3, seq_len=16, min_tokens=1, field="body")
    assert {row_text(tokenizer, result, r) for r in range(3)} == {"one line", "two\nlines", "three"}
    with pytest.raises(CalibrationDataError, match=rf"{dataset}:2: no text to calibrate on"):
        read_samples(dataset, "csv")


def test_parquet_with_messages_column(tokenizer: Any, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"}]
                for i in range(3)]  # fmt: skip
    pq.write_table(pa.table({"messages": messages}), tmp_path / "d.parquet")
    result = build(tokenizer, tmp_path / "d.parquet", num_samples=3, seq_len=64)
    assert result.stats.format == "parquet" and result.stats.chat_template_applied == 3
    assert "<|im_start|>user\nHi" in row_text(tokenizer, result, 0)


def test_saved_dataset_directory_and_its_splits(tokenizer: Any, tmp_path: Path) -> None:
    import datasets

    train = datasets.Dataset.from_dict({"text": sentences(4)})
    single = tmp_path / "single"
    train.save_to_disk(str(single))
    result = build(tokenizer, single, num_samples=4, seq_len=32)
    assert result.stats.format == "hf-dir" and result.stats.rows == 4
    files = dataset_files(single)
    assert any(f.suffix == ".arrow" for f in files) and all(f.is_file() for f in files)
    assert sorted(result.stats.files) == sorted(str(f.relative_to(single)) for f in files)

    both = tmp_path / "both"
    datasets.DatasetDict({"train": train, "test": train.select(range(1))}).save_to_disk(str(both))
    with pytest.raises(CalibrationDataError, match="has splits train, test; set calibration.split"):
        build(tokenizer, both, num_samples=1, seq_len=32)
    assert build(tokenizer, both, num_samples=1, seq_len=32, split="test").stats.samples_read == 1


def test_format_override_and_unknown_extension(tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "data.log", [{"text": "x"}])
    with pytest.raises(CalibrationDataError, match=r"set calibration.format to one of"):
        detect_format(dataset, "auto")
    assert detect_format(dataset, "jsonl") == "jsonl"
    with pytest.raises(CalibrationDataError, match="not found; fix calibration.dataset"):
        detect_format(tmp_path / "missing.jsonl", "auto")


# --- selection and tokenization ------------------------------------------------------------------


def test_seeded_selection_is_deterministic_and_moves_with_the_seed(
    tokenizer: Any, tmp_path: Path
) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in sentences(40)])
    first = build(tokenizer, dataset, num_samples=8, seq_len=32, seed=1)
    again = build(tokenizer, dataset, num_samples=8, seq_len=32, seed=1)
    other = build(tokenizer, dataset, num_samples=8, seq_len=32, seed=2)
    assert first.stats.content_hash == again.stats.content_hash
    np.testing.assert_array_equal(first.tokens.input_ids, again.tokens.input_ids)
    assert other.stats.content_hash != first.stats.content_hash
    picked = {row_text(tokenizer, first, r) for r in range(8)}
    assert picked != {row_text(tokenizer, other, r) for r in range(8)}
    assert first.stats.unused == 32 and first.stats.examined == 8


def test_duplicates_after_whitespace_normalisation_are_dropped(
    tokenizer: Any, tmp_path: Path
) -> None:
    texts = ["The same  sentence here.", " The same sentence\nhere. ", "Another sentence here."]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in [*texts, "   "]])
    result = build(tokenizer, dataset, num_samples=2, seq_len=16, min_tokens=1)
    assert result.stats.dropped.duplicate == 1 and result.stats.dropped.empty == 1
    assert {row_text(tokenizer, result, r).split()[0] for r in range(2)} == {"The", "Another"}
    kept_all = build(tokenizer, dataset, num_samples=3, seq_len=16, min_tokens=1,
                     deduplicate=False)  # fmt: skip
    assert kept_all.stats.dropped.duplicate == 0 and kept_all.stats.kept == 3


def test_one_per_row_truncates_pads_and_masks(tokenizer: Any, tmp_path: Path) -> None:
    texts = ["short one here.", " ".join(f"long{i}" for i in range(80))]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    result = build(tokenizer, dataset, num_samples=2, seq_len=20, min_tokens=1)
    ids, mask = result.tokens.input_ids, result.tokens.attention_mask
    assert ids.shape == mask.shape == (2, 20) and ids.dtype == mask.dtype == np.int64
    lengths = sorted(len(tokenizer(t)["input_ids"]) for t in texts)
    assert sorted(mask.sum(axis=1).tolist()) == [lengths[0], 20]
    for row in range(2):  # mask is a prefix of ones, the rest is padding
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, n:] == result.stats.pad_token_id).all()
    stats = result.stats
    assert stats.truncated == 1 and stats.tokens.truncated_away == lengths[1] - 20
    assert stats.tokens.padding == 40 - stats.tokens.in_rows


def test_packing_fills_every_row_and_separates_samples(tokenizer: Any, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in sentences(30)])
    result = build(tokenizer, dataset, num_samples=4, seq_len=64, packing=True)
    ids, mask = result.tokens.input_ids, result.tokens.attention_mask
    assert ids.shape == (4, 64) and mask.all()
    stats = result.stats
    eos = tokenizer.eos_token_id
    assert int((ids == eos).sum()) >= stats.kept - 1  # one EOS after each sample that fits
    stream = stats.tokens.in_kept_samples + stats.kept  # samples + their EOS separators
    assert stream == 4 * 64 + stats.tokens.packing_left_over
    assert stats.truncated == 0 and stats.tokens.padding == 0
    per_row = build(tokenizer, dataset, num_samples=4, seq_len=64)
    assert not per_row.tokens.attention_mask.all()


def test_length_limits_drop_samples(tokenizer: Any, tmp_path: Path) -> None:
    texts = ["tiny", *sentences(3, words=4), " ".join(f"w{i}" for i in range(60))]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    limits = {"seq_len": 64, "min_tokens": 5, "max_tokens": 40}
    result = build(tokenizer, dataset, num_samples=3, **limits)
    assert result.tokens.attention_mask.sum(axis=1).min() >= 5
    assert result.tokens.attention_mask.sum(axis=1).max() <= 40
    with pytest.raises(CalibrationDataError) as error:  # asking for more examines every sample
        build(tokenizer, dataset, num_samples=4, **limits)
    assert "1 shorter than min_tokens=5, 1 longer than max_tokens=40" in str(error.value)


# --- bad data ------------------------------------------------------------------------------------


def test_missing_field_names_file_and_line(tokenizer: Any, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"body": "no text field"}])
    with pytest.raises(CalibrationDataError) as error:
        build(tokenizer, dataset, num_samples=1, seq_len=8)
    assert f"{dataset}:2: no text to calibrate on" in str(error.value)
    assert "'body'" in str(error.value) and "calibration.field" in str(error.value)
    with pytest.raises(CalibrationDataError, match=rf"{dataset}:1: no field 'body'"):
        build(tokenizer, dataset, num_samples=1, seq_len=8, field="body")
    pair = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "only a prompt"}])
    with pytest.raises(CalibrationDataError, match=r"p.jsonl:1: has 'prompt' but no 'completion'"):
        build(tokenizer, pair, num_samples=1, seq_len=8)


def test_invalid_json_line_is_located(tokenizer: Any, tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"text": "a"}\n\n{"text": "b",}\n', encoding="utf-8")
    with pytest.raises(CalibrationDataError, match=rf"{dataset}:3: invalid JSON .* column 14"):
        build(tokenizer, dataset, num_samples=1, seq_len=8)
    write_jsonl(dataset, [["not", "an", "object"]])
    with pytest.raises(CalibrationDataError, match=rf"{dataset}:1: a JSON list, expected an obj"):
        build(tokenizer, dataset, num_samples=1, seq_len=8)


def test_bad_messages_are_located(tokenizer: Any, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "text": "hi"}]}])
    with pytest.raises(CalibrationDataError, match=rf"{dataset}:1: messages\[0\] must be an obj"):
        build(tokenizer, dataset, num_samples=1, seq_len=8)


def test_empty_file(tokenizer: Any, tmp_path: Path) -> None:
    for name in ("empty.jsonl", "blank.txt"):
        dataset = tmp_path / name
        dataset.write_text("" if name.endswith("jsonl") else "\n  \n\n")
        with pytest.raises(CalibrationDataError, match=rf"{dataset}: the file is empty; add"):
            build(tokenizer, dataset, num_samples=1, seq_len=8)


def test_non_utf8_file_gives_byte_offset_and_line(tokenizer: Any, tmp_path: Path) -> None:
    dataset = tmp_path / "latin.jsonl"
    good = b'{"text": "fine"}\n'
    dataset.write_bytes(good + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    offset = len(good) + len(b'{"text": "caf')
    with pytest.raises(CalibrationDataError) as error:
        build(tokenizer, dataset, num_samples=1, seq_len=8)
    assert f"{dataset}:2: not UTF-8 text (byte offset {offset}" in str(error.value)
    assert "iconv" in str(error.value)


def test_too_few_usable_samples_says_why_and_what_to_do(tokenizer: Any, tmp_path: Path) -> None:
    texts = [*sentences(3), sentences(1)[0], "hi"]
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    with pytest.raises(CalibrationDataError) as error:
        build(tokenizer, dataset, num_samples=10, seq_len=32, min_tokens=4)
    message = str(error.value)
    assert message.startswith(f"{dataset}: only 3 usable samples")
    assert "asks for 10" in message and "1 were duplicates" in message
    assert "1 shorter than min_tokens=4" in message and "lower num_samples to 3" in message
    tokens = sum(len(tokenizer(t)["input_ids"]) + 1 for t in texts[:3])  # + EOS separators
    with pytest.raises(CalibrationDataError) as error:
        build(tokenizer, dataset, num_samples=10, seq_len=32, min_tokens=4, packing=True)
    assert f"hold {tokens} tokens, enough for {tokens // 32} packed rows" in str(error.value)


def test_no_usable_sample_never_suggests_num_samples_0(tokenizer: Any, tmp_path: Path) -> None:
    """num_samples must be at least 1: with nothing usable, the hint is the data."""
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in sentences(3)])
    with pytest.raises(CalibrationDataError) as error:
        build(tokenizer, dataset, num_samples=2, seq_len=32, min_tokens=1000)
    message = str(error.value)
    assert message.startswith(f"{dataset}: no sample is usable (of 3 read")
    assert "3 shorter than min_tokens=1000" in message and message.endswith("; add data")
    with pytest.raises(CalibrationDataError) as error:  # usable, but not one packed row
        build(tokenizer, dataset, num_samples=2, seq_len=4096, packing=True)
    assert "enough for 0 packed rows" in str(error.value)
    assert "to 0" not in str(error.value) and "lower seq_len, or add data" in str(error.value)


def test_config_rejects_max_below_min() -> None:
    with pytest.raises(ValueError, match=r"max_tokens \(4\) is below min_tokens \(8\)"):
        CalibrationConfig(dataset="d.jsonl", max_tokens=4)
