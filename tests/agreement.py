"""How closely an engine's greedy tokens follow transformers' logits for the same checkpoint:
teacher-forced, so one early divergence does not compound into every token after it."""

from __future__ import annotations

from pathlib import Path

import torch


def teacher_forced_logits(
    checkpoint: Path, prompts: list[list[int]], outs: list[list[int]], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Transformers' logits for each engine token, given the engine's history before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    with torch.inference_mode():
        return [
            model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
            for prompt, out in zip(prompts, outs, strict=True)
        ]


def top1_agreement(logits: list[torch.Tensor], tokens: list[torch.Tensor]) -> float:
    picks = torch.cat([rows.argmax(-1) for rows in logits])
    return (picks == torch.cat(tokens)).float().mean().item()


def worst_rank(logits: list[torch.Tensor], tokens: list[torch.Tensor]) -> int:
    """The lowest place (0 = top) any token holds in its row of logits."""
    ranks = [
        (rows > rows.gather(1, t[:, None])).sum(1) for rows, t in zip(logits, tokens, strict=True)
    ]
    return max(int(r.max()) for r in ranks)
