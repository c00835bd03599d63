"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023):
the emitted tokens are distributed exactly as the target model's samples, whatever the draft.

For each sequence, k draft tokens x_1..x_k proposed with probabilities q_i, and the target's
p_1..p_{k+1} (p_i scores position i given the draft before it): draft token i is accepted
with probability min(1, p_i(x_i) / q_i(x_i)), in order; at the first rejection the token is
drawn from the residual max(0, p_i - q_i), renormalized, and the rest is discarded; if all k
are accepted, a bonus token is drawn from p_{k+1}. A deterministic proposer (n-gram) has
q_i one-hot on x_i: acceptance is p_i(x_i) and the residual p_i without x_i.
Greedy rows (temperature 0) accept a draft token iff it is the target's argmax, which is what
the target alone would emit: greedy outputs equal those without speculation.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """target_probs [B, k+1, V] (the last row scores the bonus position), draft_token_ids
    [B, k], draft_probs [B, k, V] or None for a deterministic draft. Returns [B, k+1] token
    ids: the accepted draft tokens, then the token drawn at the first rejection (or the
    bonus), then -1 for positions not emitted."""
    batch, k1, vocab = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    rows = torch.arange(batch, device=dev).unsqueeze(1)
    cols = torch.arange(k, device=dev).unsqueeze(0)
    p = target_probs[:, :k].float()
    if draft_probs is None:
        draft_probs = torch.zeros_like(p).scatter_(2, draft_token_ids.unsqueeze(2), 1.0)
    q = draft_probs.float()
    p_x = p[rows, cols, draft_token_ids]
    q_x = q[rows, cols, draft_token_ids]
    u = torch.rand(batch, k, device=dev, generator=generator)
    accepted = u * q_x < p_x  # u < p/q without dividing by a zero q
    # first rejected position per row (k: all accepted)
    first = torch.where(accepted.all(dim=1), k, (~accepted).float().argmax(dim=1))
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=2, keepdim=True)
    # p == q at a rejected position cannot happen (acceptance is then certain); guard 0/0
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    last = torch.cat([residual, target_probs[:, k:].float()], dim=1)  # [B, k+1, V]
    chosen = last[torch.arange(batch, device=dev), first]  # [B, V]
    final = torch.multinomial(chosen, 1, generator=generator).squeeze(1)
    out = torch.full((batch, k1), -1, dtype=torch.long, device=dev)
    keep = cols < first.unsqueeze(1)
    out[:, :k] = torch.where(keep, draft_token_ids, out[:, :k])
    out[torch.arange(batch, device=dev), first] = final
    return out


def greedy_accept(target_argmax: torch.Tensor, draft_token_ids: torch.Tensor) -> torch.Tensor:
    """target_argmax [B, k+1], draft_token_ids [B, k] -> [B, k+1] as rejection_sample: the
    matching prefix of the draft, then the target's own token, then -1."""
    batch, k1 = target_argmax.shape
    k = k1 - 1
    match = target_argmax[:, :k] == draft_token_ids
    first = torch.where(match.all(dim=1), k, (~match).float().argmax(dim=1))
    cols = torch.arange(k1, device=target_argmax.device).unsqueeze(0)
    return torch.where(cols <= first.unsqueeze(1), target_argmax,
                       torch.full_like(target_argmax, -1))
