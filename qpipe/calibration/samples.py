"""One raw calibration sample and how a record (JSONL line, table row) becomes one.

Every format funnels through `sample_from_row`, so a field means the same thing in JSONL, CSV,
Parquet and a saved dataset, and every error names where the record came from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qpipe.stages.base import StageError

# Field pairs read as a two-turn conversation (user asks, assistant answers).
PAIR_FIELDS: tuple[tuple[str, str], ...] = (("prompt", "completion"), ("question", "answer"))


class CalibrationDataError(StageError):
    """Calibration data that cannot be used: the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class RawSample:
    """Either plain text or a conversation, with `origin` ("file:line") for errors and stats."""

    origin: str
    text: str | None = None
    messages: tuple[Message, ...] | None = None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _messages(value: Any, origin: str, name: str) -> tuple[Message, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise CalibrationDataError(
                f"{origin}: field {name!r} is a string that is not a JSON list of messages "
                f'({exc.msg}); write it as [{{"role": "user", "content": "..."}}, ...]'
            ) from exc
    if not isinstance(value, list | tuple) or not value:
        raise CalibrationDataError(
            f"{origin}: field {name!r} must be a non-empty list of "
            f'{{"role": ..., "content": ...}} messages, got {_kind(value)}'
        )
    messages = []
    for index, item in enumerate(value):
        role = item.get("role") if isinstance(item, Mapping) else None
        content = item.get("content") if isinstance(item, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise CalibrationDataError(
                f"{origin}: {name}[{index}] must be an object with string 'role' and 'content' "
                f"(got {item!r:.80}); fix that message"
            )
        messages.append(Message(role=role, content=content))
    return tuple(messages)


def _content(value: Any, origin: str, name: str) -> RawSample:
    if isinstance(value, str):
        return RawSample(origin=origin, text=value)
    if isinstance(value, list | tuple):
        return RawSample(origin=origin, messages=_messages(value, origin, name))
    raise CalibrationDataError(
        f"{origin}: field {name!r} is {_kind(value)}, expected a string (text) or a list of "
        "messages; fix the record or point calibration.field at another field"
    )


def _pair(row: Mapping[str, Any], origin: str, first: str, second: str) -> RawSample:
    turns = []
    for role, name in (("user", first), ("assistant", second)):
        value = row[name]
        if not isinstance(value, str):
            raise CalibrationDataError(
                f"{origin}: field {name!r} is {_kind(value)}, expected a string; fix the record"
            )
        turns.append(Message(role=role, content=value))
    return RawSample(origin=origin, messages=tuple(turns))


def sample_from_row(row: Mapping[str, Any], origin: str, field: str | None) -> RawSample:
    """The sample a record holds: `field` if given, else messages, a prompt pair, or text."""
    keys = ", ".join(repr(k) for k in row) or "none"
    if field is not None:
        if field not in row:
            raise CalibrationDataError(
                f"{origin}: no field {field!r} (calibration.field); this record has {keys}. "
                "Add the field, or set calibration.field to the one holding the text"
            )
        return _content(row[field], origin, field)
    if "messages" in row:
        return RawSample(origin=origin, messages=_messages(row["messages"], origin, "messages"))
    for first, second in PAIR_FIELDS:
        if first in row and second in row:
            return _pair(row, origin, first, second)
    if "text" in row:
        return _content(row["text"], origin, "text")
    for first, second in PAIR_FIELDS:
        if first in row or second in row:
            have, lack = (first, second) if first in row else (second, first)
            raise CalibrationDataError(
                f"{origin}: has {have!r} but no {lack!r}; add {lack!r} to the record, or set "
                f"calibration.field: {have} to use {have!r} alone"
            )
    raise CalibrationDataError(
        f"{origin}: no text to calibrate on: expected a 'text', 'messages' or "
        f"'prompt'+'completion' field, this record has {keys}. Rename the field, or set "
        "calibration.field to it"
    )
