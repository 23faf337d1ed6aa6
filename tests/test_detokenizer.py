"""Incremental detokenization: `tokenizers`' DecodeStream for fast tokenizers, the two-decode window
for any other, the same text from both, and stop strings on top."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from qpipe.serve.detokenizer import IncrementalDetokenizer


class DecodeOnly:
    """A tokenizer with no `tokenizers` backend, as the detokenizer sees one: only `decode`, whose
    calls it counts."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


class CountingFast(DecodeOnly):
    """The same with the fast tokenizer's backend showing."""

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer.backend_tokenizer


@pytest.fixture(scope="module")
def fast(tiny_llama_checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_checkpoint)


@pytest.fixture(params=["stream", "window"])
def tokenizer(request: pytest.FixtureRequest, fast: PreTrainedTokenizerBase) -> object:
    return fast if request.param == "stream" else DecodeOnly(fast)


def pieces(tokenizer: object, prompt: Sequence[int], output: Sequence[int]) -> list[str]:
    """What a stream sends, token by token, then at the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt)  # type: ignore[arg-type]
    return [detok.add_tokens([token_id]) for token_id in output] + [detok.flush()]


def encode(tokenizer: PreTrainedTokenizerBase | DecodeOnly, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_detokenizer_never_emits_partial_utf8(tokenizer) -> None:  # noqa: ANN001
    text = "Grüße 🦙🚀 naïve café — 日本語のテキスト"
    sent = pieces(tokenizer, encode(tokenizer, "Say:"), encode(tokenizer, text))
    assert all("\ufffd" not in piece for piece in sent)
    assert "".join(sent) == text
    assert sum(not piece for piece in sent[:-1]) > 0, "tokens ending mid-character are held back"


def test_detokenizer_cuts_at_stop_string_and_holds_back_its_prefix(tokenizer) -> None:  # noqa: ANN001
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three f"])
    sent = []
    for token_id in encode(tokenizer, "one two three four five"):
        sent.append(detok.add_tokens([token_id]))
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(sent) + detok.flush() == "one two "
    assert not any("thr" in piece for piece in sent), "a stop-string prefix must not be sent"


def test_stop_text_is_left_out_unless_included(tokenizer) -> None:  # noqa: ANN001
    """vLLM's rule: the matched stop string, and the text of the token that stopped the request
    (EOS or a stop token id), stay out of the output unless include_stop_str_in_output."""
    ids = encode(tokenizer, "one two three four")
    for include, expected in ((False, "one two "), (True, "one two three")):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["three"], include_stop=include)
        sent = "".join(detok.add_tokens([token_id]) for token_id in ids)
        assert detok.stopped and sent + detok.flush() == expected
    last = encode(tokenizer, "one two.")
    for include, expected in ((False, "one two"), (True, "one two.")):
        detok = IncrementalDetokenizer(tokenizer, [], include_stop=include)
        text = detok.add_tokens(last, stop_terminated=True) + detok.flush()
        assert text == expected


def test_detokenizer_ignores_stop_strings_within_min_tokens(tokenizer) -> None:  # noqa: ANN001
    first_two = len(encode(tokenizer, "one two"))
    detok = IncrementalDetokenizer(tokenizer, [], stop=["two"], min_tokens=first_two)
    text = ""
    for token_id in encode(tokenizer, "one two one two one"):
        text += detok.add_tokens([token_id])
        if detok.stopped:
            break
    assert detok.stopped
    assert text + detok.flush() == "one two one "


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's and Mistral's kind: "▁" for spaces, bytes as `<0x..>` tokens, the first space
    stripped on decode (so a token's text depends on what comes before it)."""
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    text = ["the quick brown fox jumps over the lazy dog", "naïve café 日本語 🦙", "one two three"]
    backend.train_from_iterator(
        text * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_stream_and_window_send_the_same_pieces(kind: str, fast: PreTrainedTokenizerBase) -> None:
    """Random prompts and outputs, piece for piece. Byte-level (SmolLM2): a third of the tokens from
    the vocabulary's start, special tokens (skipped) and single bytes (which end mid-character)."""
    tokenizer = fast if kind == "byte-level" else metaspace_tokenizer()
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(300):
        draw = [
            rng.randrange(vocab) if rng.random() < 0.7 else rng.randrange(300) for _ in range(48)
        ]
        prompt, output = draw[: (cut := rng.randrange(10))], draw[cut:]
        assert pieces(tokenizer, prompt, output) == pieces(DecodeOnly(tokenizer), prompt, output)


def test_a_prompt_ending_mid_character_is_not_sent(fast: PreTrainedTokenizerBase) -> None:
    """DecodeStream takes a context whose text ends in U+FFFD for no context, and would send it."""
    partial = fast.encode("🦙", add_special_tokens=False)[:1]
    prompt = fast.encode("Say:", add_special_tokens=False) + partial
    assert fast.decode(prompt).endswith("\ufffd")
    output = fast.encode(" maternal care", add_special_tokens=False)
    assert pieces(fast, prompt, output) == pieces(DecodeOnly(fast), prompt, output)
    assert "".join(pieces(fast, prompt, output)) == " maternal care"


def test_fast_tokenizers_decode_without_python_calls(fast: PreTrainedTokenizerBase) -> None:
    """The per-token path of a fast tokenizer is one Rust call: transformers' `decode` (~10 µs a
    call, two per token in the window) is never reached."""
    counting = CountingFast(fast)
    text = "".join(pieces(counting, encode(fast, "Say:"), encode(fast, "one two three four")))
    assert text == "one two three four"
    assert counting.calls == 0


class _Shout:
    """A decoder whose text for a token depends on the token after it: "!" upper-cases the word
    before, which `DecodeStream` refuses as an invalid prefix."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out: list[str] = []
        for token in tokens:
            if token == "!" and out:
                out[-1] = out[-1].upper()
            out.append(token if token == "!" else f" {token}")
        return out


def test_a_token_that_changes_earlier_text_continues_in_the_window() -> None:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "!": 3, "c": 4}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    shouting = PreTrainedTokenizerFast(tokenizer_object=word_level)
    # set after wrapping: transformers deep-copies the backend, and a Python decoder cannot be
    shouting.backend_tokenizer.decoder = decoders.Decoder.custom(_Shout())
    output = [1, 2, 3, 4, 1]
    assert shouting.decode(output) == " a B! c a"
    sent = pieces(shouting, [], output)
    assert sent == [" a", " b", "!", " c", " a", ""], "what was sent stays; the rest continues"
    assert sent == pieces(DecodeOnly(shouting), [], output)
