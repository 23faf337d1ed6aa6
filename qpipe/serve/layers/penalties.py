"""Logit bias, `min_tokens` and the presence, frequency and repetition penalties, for a whole
batch at once.

They run on the logits before the token is chosen (greedy included) and in vLLM's order: bias and
the ban on ending before `min_tokens`, then repetition, then frequency and presence. Each step
rebuilds the token counts from the sequences' token lists, so a request preempted and recomputed
resumes with the same counts. A handful of batched ops whatever the number of rows: one launch
each on a GPU, not one per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qpipe.serve.sampling_params import SamplingParams
    from qpipe.serve.sequence import Sequence


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] fp32: how often each token occurs in each list."""
    width = max(len(tokens) for tokens in token_lists)
    # pads point one past the vocabulary, a column dropped at the end
    padded = [tokens + [vocab] * (width - len(tokens)) for tokens in token_lists]
    ids = torch.tensor(padded, dtype=torch.long).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """`logits` ([rows, vocab] fp32, row i for seqs[i]) with each request's bias, penalties and
    `min_tokens` ban on EOS (unless ignored) and its stop token ids applied; the same tensor when
    no request asks for any."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    params = [seqs[i].params for i in rows]
    index = torch.tensor(rows, device=device)
    picked = logits[index]  # a copy
    bias = [(r, t, v) for r, p in enumerate(params) for t, v in p.logit_bias]
    if bias:
        r, t, v = zip(*bias, strict=True)
        where = (torch.tensor(r, device=device), torch.tensor(t, device=device))
        picked.index_put_(where, torch.tensor(v, device=device), accumulate=True)
    banned = [
        (r, token)
        for r, i in enumerate(rows)
        if seqs[i].num_completion_tokens < params[r].min_tokens
        for token in _ending_tokens(params[r], eos_token_ids)
        if token < vocab
    ]
    if banned:
        r, t = zip(*banned, strict=True)
        picked[torch.tensor(r, device=device), torch.tensor(t, device=device)] = float("-inf")
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _token_counts([seqs[i].token_ids for i in rows], vocab, device) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        # HF's rule: a seen token's positive logit shrinks, a negative one grows more negative
        scaled = torch.where(picked > 0, picked / penalty, picked * penalty)
        picked = torch.where(seen, scaled, picked)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = _token_counts([seqs[i].completion_token_ids for i in rows], vocab, device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        picked -= frequency * counts + presence * (counts > 0)
    adjusted = logits.clone()
    adjusted[index] = picked
    return adjusted


def _ending_tokens(params: SamplingParams, eos_token_ids: frozenset[int]) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
