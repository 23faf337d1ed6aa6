"""Benchmark prompts: random token prompts of an exact length, a JSONL file, or a ShareGPT dump.

Every prompt carries its token count and the output length to ask for, because the metrics need the
input side of the token throughput and random prompts must be exactly `input_len` tokens long to be
comparable with `vllm bench serve` runs of the same shape.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qpipe.bench.config import LoadProfile

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str
    prompt_len: int
    output_len: int


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A Hugging Face tokenizer from a local directory (a checkpoint or qpipe artifact). A path
    that is not one fails here, naming it, not as transformers' Hub lookup error."""
    from transformers import AutoTokenizer

    fix = "give the model's checkpoint or artifact directory (--tokenizer DIR)"
    if not Path(path).is_dir():
        raise ValueError(f"tokenizer {path}: not a directory; {fix}")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"tokenizer {path}: no tokenizer could be loaded from it (tokenizer.json or "
            f"tokenizer_config.json with its vocabulary); {fix}"
        ) from exc


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_prompts(
    tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> list[BenchPrompt]:
    """Prompts of random tokens that re-tokenize to exactly `input_len` tokens.

    Random ids do not always survive decode→encode (merges across token boundaries), so each prompt
    is re-encoded and trimmed or padded until its length is exact; different prompts never share a
    prefix, so the server's prefix cache cannot flatter the numbers.
    """
    rng = random.Random(seed)
    vocab = _vocab_size(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    prompts = []
    for _ in range(num_prompts):
        ids = [_random_id(rng, vocab, special) for _ in range(input_len)]
        for _attempt in range(10):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == input_len:
                break
            ids = ids[:input_len] + [
                _random_id(rng, vocab, special) for _ in range(input_len - len(ids))
            ]
        else:
            raise ValueError(
                f"could not build a random prompt of exactly {input_len} tokens with this "
                "tokenizer; use --dataset FILE.jsonl instead"
            )
        prompts.append(BenchPrompt(text, input_len, output_len))
    return prompts


@dataclass(frozen=True)
class DatasetRow:
    text: str
    output_len: int | None  # None: the load profile's output length


def jsonl_rows(path: Path) -> list[DatasetRow]:
    """A JSONL file: one object per line with `prompt` (or `text`), optional `output_len`."""
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not valid JSON: {exc.msg}") from exc
        text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'{path}:{line_no}: each line needs a "prompt" (or "text") string')
        output_len = row.get("output_len")
        if output_len is not None and (
            not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1
        ):
            raise ValueError(
                f'{path}:{line_no}: "output_len" is {output_len!r}; give a whole number of tokens '
                "> 0, or leave it out to use --output-len"
            )
        rows.append(DatasetRow(text, output_len))
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return rows


def sharegpt_rows(path: Path) -> list[DatasetRow]:
    """The first human turn of each ShareGPT conversation, asking for the profile's output length
    (a fixed length keeps runs comparable; the recorded answers' lengths vary with the sample)."""
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    rows = []
    for entry in data:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        question = str(turns[0].get("value", "")) if turns else ""
        if question:
            rows.append(DatasetRow(question, None))
    if not rows:
        raise ValueError(f"{path}: no conversation with a first turn")
    return rows


def prompt_sets(
    dataset: str, tokenizer: Tokenizer | None, profiles: list[LoadProfile], seed: int
) -> list[list[BenchPrompt]]:
    """One prompt set per profile (`random`, a `.jsonl` or a ShareGPT `.json` file), no two sets
    sharing a prompt, so a server's prefix cache cannot serve one set's prompts from another's.

    Random set i is drawn with seed + i. A file's prompts are shuffled with the seed and dealt out
    in order; when the file holds too few for every set to get its own, dealing starts over, and a
    warning says so.
    """
    if dataset == "random":
        if tokenizer is None:
            raise ValueError(
                "random prompts of an exact input length need the model's tokenizer: "
                "pass --tokenizer DIR (a checkpoint or artifact directory)"
            )
        return [
            random_prompts(tokenizer, p.num_prompts, p.input_len, p.output_len, seed + i)
            for i, p in enumerate(profiles)
        ]
    rows = _dataset_rows(dataset)
    random.Random(seed).shuffle(rows)
    needed = sum(p.num_prompts for p in profiles)
    if needed > len(rows):
        log.warning(
            "--dataset %s holds %d prompts but this run sends %d (warm-up, every level and "
            "repeat): prompts repeat, and a server's prefix cache serves repeats faster. Use a "
            "larger dataset or fewer --num-prompts, --concurrency levels or --repeats.",
            dataset,
            len(rows),
            needed,
        )
    dealt = itertools.cycle(rows)
    return [
        [
            _prompt(tokenizer, row.text, row.output_len or p.output_len)
            for row in itertools.islice(dealt, p.num_prompts)
        ]
        for p in profiles
    ]


def _dataset_rows(dataset: str) -> list[DatasetRow]:
    path = Path(dataset)
    if not path.is_file():
        raise ValueError(f"--dataset {dataset!r}: not 'random' and not a file")
    if path.suffix == ".jsonl":
        return jsonl_rows(path)
    if path.suffix == ".json":
        return sharegpt_rows(path)
    raise ValueError(f"--dataset {dataset!r}: use 'random', a .jsonl file or a ShareGPT .json file")


def _prompt(tokenizer: Tokenizer | None, text: str, output_len: int) -> BenchPrompt:
    # NOTE: without a tokenizer the input length stays 0 here and the server's usage fills it in.
    return BenchPrompt(text, count_tokens(tokenizer, text) if tokenizer else 0, output_len)


def _vocab_size(tokenizer: Any) -> int:
    size = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    return int(size)


def _random_id(rng: random.Random, vocab: int, special: set[int]) -> int:
    while True:
        token = rng.randrange(vocab)
        if token not in special:
            return token
