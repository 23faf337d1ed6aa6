"""Turns the last-token logits of a batch into next tokens, batched across requests.

Bias, penalties and `min_tokens` first adjust the logits of the requests that ask for them, then
a structured output's grammar rules out the tokens that would break it.
Greedy rows then take the argmax; the others are tempered, min-p/top-k/top-p filtered and sampled.
Requests with a seed draw from their own generator (kept on the sequence); the rest share one
batched draw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qpipe.serve.layers.penalties import apply_penalties
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.structured_output import apply_grammars

if TYPE_CHECKING:
    from qpipe.serve.sequence import Sequence


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]
) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits: [batch, vocab] fp32, row i for seqs[i]. Returns token ids and, where asked,
    {token: logprob} with the chosen token and the `logprobs` most likely ones (from the
    distribution before bias, penalties, grammar and filters, as vLLM's default)."""
    batch = logits.shape[0]
    params = [seq.params for seq in seqs]
    adjusted = apply_grammars(apply_penalties(logits, seqs, eos_token_ids), logits, seqs)
    tokens = adjusted.max(dim=-1).indices  # argmax's result; 2.5x faster on CPU (torch 2.13)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(adjusted[rows], [params[i] for i in random_rows])
        shared = [j for j, i in enumerate(random_rows) if seqs[i].generator is None]
        if shared:
            picked = torch.multinomial(probs[shared], 1).squeeze(1)
            tokens[rows[shared]] = picked
        for j, i in enumerate(random_rows):
            generator = seqs[i].generator
            if generator is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generator)[0]
    token_list = tokens.tolist()
    logprobs: list[dict[int, float] | None] = [None] * batch
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        entries = token_logprobs(
            logits[wanted], [token_list[i] for i in wanted], [params[i].logprobs for i in wanted]
        )
        for i, entry in zip(wanted, entries, strict=True):
            logprobs[i] = entry
    return token_list, logprobs


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top: list[int | None]
) -> list[dict[int, float]]:
    """Per row, {token: logprob} for `tokens[row]` and the `top[row]` most likely tokens, from the
    unmodified distribution: sampled tokens' logprobs and prompt logprobs alike."""
    all_logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = all_logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    chosen_list = chosen.squeeze(1).tolist()
    entries = []
    k_max = max((k or 0 for k in top), default=0)
    best = all_logprobs.topk(k_max) if k_max else None
    for row, (token, k) in enumerate(zip(tokens, top, strict=True)):
        entry = {token: chosen_list[row]}
        if best is not None and k:
            ids, values = best.indices[row, :k].tolist(), best.values[row, :k].tolist()
            entry.update(zip(ids, values, strict=True))
        entries.append(entry)
    return entries


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution. Every row keeps at least its most likely token, and a
    logit that a repetition penalty pushed past fp32's range is the largest finite one instead of
    inf, which would turn the softmax into NaN: valid parameters never fail the batch's draw."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = (logits / temps.unsqueeze(1)).clamp_(max=torch.finfo(logits.dtype).max)
    if any(p.min_p > 0 for p in params):  # on the tempered distribution, before top-k/top-p
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= top_k.to(logits.device).unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p, and the first token whatever it
        # is (a top_p that rounds to 0 in fp32 would otherwise drop every token).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)
