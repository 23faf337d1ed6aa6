"""Samples to the exact text the model will see: conversations go through the model's chat template.

Calibrating on conversations rendered the way they will be served matters: the template's role
markers and special tokens are among the activations the quantization scales must cover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qpipe.calibration.samples import CalibrationDataError, Message, RawSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RenderedSample:
    origin: str
    text: str
    # Rendered by the chat template: it already holds its special tokens, so none are added again.
    templated: bool


def join_plain(messages: tuple[Message, ...]) -> str:
    """Turns concatenated as text (no template): a newline between turns unless one is there."""
    text = ""
    for message in messages:
        joint = "" if not text or text[-1].isspace() or message.content[:1].isspace() else "\n"
        text += joint + message.content
    return text


def render(
    sample: RawSample, tokenizer: PreTrainedTokenizerBase, use_chat_template: bool
) -> RenderedSample:
    if sample.messages is None:
        return RenderedSample(sample.origin, sample.text or "", templated=False)
    if not use_chat_template:
        return RenderedSample(sample.origin, join_plain(sample.messages), templated=False)
    turns = [{"role": m.role, "content": m.content} for m in sample.messages]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception as exc:  # NOTE: jinja templates raise whatever they like (TemplateError, ...)
        raise CalibrationDataError(
            f"{sample.origin}: the model's chat template rejected this conversation ({exc}); "
            "fix the conversation (roles, order) or set calibration.apply_chat_template: false"
        ) from exc
    return RenderedSample(sample.origin, text, templated=True)
