"""What `--baseline` / `--candidate` name: an HF checkpoint directory or an OpenAI endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# What transformers loads a checkpoint's weights from, sharded or not.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class ModelRef:
    """A checkpoint directory (`path`) or a server (`url`, e.g. http://127.0.0.1:8000)."""

    spec: str

    @property
    def is_endpoint(self) -> bool:
        return self.spec.startswith(("http://", "https://"))

    @property
    def path(self) -> Path:
        return Path(self.spec).expanduser().resolve()

    @property
    def url(self) -> str:
        """The server root, without a trailing `/v1`."""
        return self.spec.rstrip("/").removesuffix("/v1")

    def check(self) -> None:
        """Fail early, naming the model, instead of deep inside transformers or lm-eval."""
        if self.is_endpoint:
            return
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.spec}: not an HF checkpoint directory (no config.json); pass a checkpoint "
                "directory or an http:// endpoint"
            )
        if not any(path for pattern in WEIGHT_FILES for path in self.path.glob(pattern)):
            raise FileNotFoundError(
                f"{self.spec}: has config.json but no weight files ({', '.join(WEIGHT_FILES)}); "
                "pass a complete checkpoint directory (was it fully downloaded or written?)"
            )

    def served_model_name(self) -> str:
        """The endpoint's first model id (GET /v1/models): lm-eval sends it with each request."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
                models = json.load(response)["data"]
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            raise ConnectionError(
                f"{self.url}/v1/models: cannot list the endpoint's models ({exc}); is the server "
                "up and OpenAI-compatible?"
            ) from exc
        if not models:
            raise ConnectionError(f"{self.url}/v1/models: the endpoint serves no model")
        return str(models[0]["id"])


def load_causal_lm(ref: ModelRef, dtype: str) -> PreTrainedModel:
    """An HF checkpoint, 16-bit or compressed-tensors (transformers decompresses it)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref.check()
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch_dtype)
    except ImportError as exc:
        raise ImportError(
            f"{ref.spec}: loading this checkpoint needs a package that is missing ({exc}); "
            "compressed-tensors checkpoints need `pip install compressed-tensors`"
        ) from exc
    return model.eval()
