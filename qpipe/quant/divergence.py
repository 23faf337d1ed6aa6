"""How far a quantized model's next-token distributions are from the 16-bit model's.

KL divergence against the baseline is far more sensitive than task accuracy at the sample sizes a
CPU can afford, and needs no labels; perplexity on the same windows is reported alongside because
people know what it means. Used by sensitivity, auto_keep_16bit and the bench (the evaluate stage
writes the user-facing reports).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TEXT_FIELDS = (("text",), ("question", "answer"), ("prompt", "completion"))


@dataclass(frozen=True)
class Divergence:
    kld: float
    """Mean KL(16-bit || quantized) per predicted token, in nats."""
    perplexity: float
    top1_agreement: float


def read_texts(path: Path) -> list[str]:
    """Plain text (one document) or JSONL with text, question+answer or prompt+completion fields."""
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        fields = next((f for f in TEXT_FIELDS if all(k in record for k in f)), None)
        if fields is None:
            raise ValueError(
                f"{path}:{number}: no text field; held-out JSONL needs 'text', "
                "'question'+'answer' or 'prompt'+'completion'"
            )
        texts.append("\n".join(str(record[k]) for k in fields))
    return texts


def heldout_windows(
    tokenizer: Any, texts: list[str], num_windows: int, seq_len: int
) -> torch.Tensor:
    """Documents joined by blank lines and cut into `num_windows` full windows of `seq_len`."""
    import torch

    ids: list[int] = []
    need = num_windows * seq_len
    for text in texts:
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(
            f"held-out text has {len(ids)} tokens, fewer than {num_windows} windows x {seq_len}; "
            "give more text or lower num_windows/seq_len"
        )
    return torch.tensor(ids[:need]).view(num_windows, seq_len)


def windows_from_calibration(calibration_file: Path, num_windows: int) -> torch.Tensor:
    """Unpadded calibration rows cut to a common length (the shortest kept row)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(calibration_file))
    rows = [
        ids[m.bool()]
        for ids, m in zip(tensors["input_ids"], tensors["attention_mask"], strict=True)
    ]
    rows = sorted((r for r in rows if len(r) > 1), key=len, reverse=True)[:num_windows]
    if not rows:
        raise ValueError(f"{calibration_file}: no calibration row has two or more tokens")
    length = min(len(r) for r in rows)
    return torch.stack([r[:length] for r in rows])


def log_probs(model: Any, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """Next-token log-probabilities [N, T-1, V] (float32) for every window."""
    import torch

    outs = []
    with torch.no_grad():
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch).logits[:, :-1].float()
            outs.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(outs)


def compare(
    reference: torch.Tensor, model: Any, windows: torch.Tensor, batch_size: int = 4
) -> Divergence:
    """KLD/perplexity/top-1 agreement of `model` against reference log-probs on the same windows."""
    import torch

    kl_sum = nll_sum = agree = 0.0
    count = 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size]
            ref = reference[start : start + batch_size]
            logits = model(input_ids=batch).logits[:, :-1].float()
            cand = torch.log_softmax(logits, dim=-1)
            kl_sum += (ref.exp() * (ref - cand)).sum(-1).sum().item()
            targets = batch[:, 1:]
            nll_sum -= cand.gather(-1, targets.unsqueeze(-1)).sum().item()
            agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
            count += targets.numel()
    return Divergence(
        kld=kl_sum / count, perplexity=math.exp(nll_sum / count), top1_agreement=agree / count
    )


def perplexity(reference: torch.Tensor, windows: torch.Tensor) -> float:
    targets = windows[:, 1:].unsqueeze(-1)
    return math.exp(-reference.gather(-1, targets).mean().item())
