"""The served model's tokenizer: transformers' own, from the checkpoint or artifact directory."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{model_dir}: no usable tokenizer ({err}); copy tokenizer.json and "
            "tokenizer_config.json from the source model into this directory"
        ) from err
