"""Data qpipe ships so evaluations run offline: where each file is (see README.md for sources)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
GSM8K_EVAL = DATA_DIR / "gsm8k" / "eval.jsonl"
GSM8K_FEWSHOT = DATA_DIR / "gsm8k" / "fewshot.jsonl"
WIKITEXT2_TEST = DATA_DIR / "wikitext-2" / "test.txt"
