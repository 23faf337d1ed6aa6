"""The served model's tokenizer: transformers' own, from the checkpoint or artifact directory."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        # NOTE: transformers 5 skips this clean-up for BPE vocabularies (the whole Llama family)
        # and then warns, on the first decode, that it would have been destructive; asking for
        # none gives the same text without a warning that reads like corrupted output
        return AutoTokenizer.from_pretrained(model_dir, clean_up_tokenization_spaces=False)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{model_dir}: no usable tokenizer ({err}); copy tokenizer.json and "
            "tokenizer_config.json from the source model into this directory"
        ) from err


def backend_of(tokenizer: object) -> BackendTokenizer | None:
    """The `tokenizers` library's tokenizer behind a fast transformers tokenizer (one Rust call
    per encode or decode step), or None for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, BackendTokenizer) else None
