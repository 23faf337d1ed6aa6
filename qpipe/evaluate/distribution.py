"""qpipe's own fast, sensitive checks: how far the candidate's next-token distributions move.

Both models score the same token windows of held-out text in one batched pass. Per batch we take
both models' logits, turn them into log-probabilities one window at a time, and keep only small
per-token numbers (NLL, KL divergence, top-1 agreement): memory stays bounded by one batch of
logits however much text is scored. Per-window values are kept for the paired bootstrap.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qpipe.evaluate.significance import BootstrapResult, Comparison, Statistic, paired_bootstrap

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class DistributionStats:
    """Per-window sums and per-token KLD of one baseline-vs-candidate pass.

    Each window of T tokens gives T-1 predictions: `nll_*` [W] sum a window's negative
    log-likelihoods, `agree` [W] counts its top-1 agreements, `kld` [W, T-1] is KL(baseline ||
    candidate) in nats per predicted token.
    """

    nll_baseline: np.ndarray
    nll_candidate: np.ndarray
    agree: np.ndarray
    kld: np.ndarray
    seconds: float
    load_seconds: float = 0.0

    @property
    def predictions(self) -> int:
        return int(self.kld.size)

    @property
    def ppl_baseline(self) -> float:
        return float(np.exp(self.nll_baseline.sum() / self.predictions))

    @property
    def ppl_candidate(self) -> float:
        return float(np.exp(self.nll_candidate.sum() / self.predictions))

    @property
    def top1_agreement(self) -> float:
        return float(self.agree.sum() / self.predictions)

    @property
    def position_kld(self) -> np.ndarray:
        """Mean KLD at each position of a window: does damage grow with context length?"""
        return self.kld.mean(axis=0)


def token_windows(
    text_file: Path, tokenizer: PreTrainedTokenizerBase, max_tokens: int, window: int
) -> torch.Tensor:
    """The first `max_tokens` tokens of the file as non-overlapping windows [W, window].

    Only as much text as needed is tokenized (a 1 MB file need not be, for 16k tokens).
    """
    import torch

    text = text_file.read_text(encoding="utf-8")
    chars = max_tokens * 8
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= max_tokens or chars >= len(text):
            break
        chars *= 2
    count = min(len(ids), max_tokens) // window
    if count == 0:
        raise ValueError(
            f"{text_file}: {len(ids)} tokens, fewer than one window of {window}; give more text "
            "or a smaller evaluate.window / --window"
        )
    return torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)


def compare_distributions(
    baseline: PreTrainedModel,
    candidate: PreTrainedModel,
    batches: Iterable[torch.Tensor],
) -> DistributionStats:
    """Score batches of token windows [B, T] with both models."""
    import torch

    start = time.perf_counter()
    nll_b, nll_c, agree, kld = [], [], [], []
    with torch.inference_mode():
        for batch in batches:
            logits_b = baseline(input_ids=batch).logits
            logits_c = candidate(input_ids=batch).logits
            if logits_b.shape != logits_c.shape:
                raise ValueError(
                    f"baseline and candidate logits differ in shape ({tuple(logits_b.shape)} vs "
                    f"{tuple(logits_c.shape)}): the models must share a tokenizer and vocabulary"
                )
            targets = batch[:, 1:, None]
            for row in range(batch.shape[0]):
                # NOTE: one window at a time keeps the fp32 [T, vocab] temporaries small.
                logp_b = torch.log_softmax(logits_b[row, :-1].float(), dim=-1)
                logp_c = torch.log_softmax(logits_c[row, :-1].float(), dim=-1)
                nll_b.append(-logp_b.gather(-1, targets[row]).sum().item())
                nll_c.append(-logp_c.gather(-1, targets[row]).sum().item())
                agree.append((logp_b.argmax(-1) == logp_c.argmax(-1)).sum().item())
                token_kld = (logp_b.exp() * (logp_b - logp_c)).sum(-1).clamp_min(0)
                kld.append(token_kld.numpy())
    return DistributionStats(
        nll_baseline=np.array(nll_b),
        nll_candidate=np.array(nll_c),
        agree=np.array(agree, dtype=np.int64),
        kld=np.stack(kld).astype(np.float64),
        seconds=time.perf_counter() - start,
    )


def distribution_comparisons(
    stats: DistributionStats, *, iterations: int, confidence: float, seed: int
) -> list[Comparison]:
    """Perplexity, ppl ratio, KLD (mean/p99/max), top-1 agreement, each with a window bootstrap."""
    per_window = stats.kld.shape[1]
    kld_window_mean = stats.kld.mean(axis=1)
    nll_diff = stats.nll_candidate - stats.nll_baseline

    def ppl(nll: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.exp(nll[rows].sum(axis=1) / (rows.shape[1] * per_window))

    def boot(statistic: Statistic, n_iter: int = iterations) -> BootstrapResult:
        return paired_bootstrap(
            len(kld_window_mean), statistic, iterations=n_iter, confidence=confidence, seed=seed
        )

    ppl_drop = boot(lambda r: ppl(stats.nll_candidate, r) - ppl(stats.nll_baseline, r))
    ratio = boot(lambda r: ppl(nll_diff, r) - 1)
    kld_mean = boot(lambda r: kld_window_mean[r].mean(axis=1))
    # NOTE: a quantile per resample is costlier than a mean; 1000 resamples keep it to ~1 s.
    kld_p99 = boot(
        lambda r: np.quantile(stats.kld[r].reshape(len(r), -1), 0.99, axis=1),
        min(iterations, 1000),
    )
    disagree = boot(lambda r: 100 - stats.agree[r].sum(axis=1) * 100 / (r.shape[1] * per_window))
    return [
        Comparison(
            "perplexity",
            stats.ppl_baseline,
            stats.ppl_candidate,
            ppl_drop.estimate,
            ppl_drop.interval,
            ppl_drop.p_value,
        ),
        Comparison(
            "ppl_ratio",
            1.0,
            1 + ratio.estimate,
            ratio.estimate,
            ratio.interval,
            ratio.p_value,
            "ratio - 1",
        ),
        Comparison(
            "kld_mean",
            0.0,
            kld_mean.estimate,
            kld_mean.estimate,
            kld_mean.interval,
            kld_mean.p_value,
            "nats/token",
        ),
        Comparison(
            "kld_p99",
            0.0,
            kld_p99.estimate,
            kld_p99.estimate,
            kld_p99.interval,
            kld_p99.p_value,
            "nats/token",
        ),
        Comparison(
            "kld_max",
            0.0,
            float(stats.kld.max()),
            float(stats.kld.max()),
            None,
            None,
            "nats/token",
        ),
        Comparison(
            "top1_agreement",
            100.0,
            100 - disagree.estimate,
            disagree.estimate,
            disagree.interval,
            disagree.p_value,
            "points",
        ),
    ]
