"""The sampler: logits -> next tokens and their logprobs, vectorized over the batch.

Order per row: penalties (repetition, frequency, presence), min_tokens masking, then greedy
argmax, or temperature -> top-k -> top-p -> min-p -> a draw. Returned logprobs are those of
the raw model distribution (before penalties and temperature), as vLLM reports them.
Seeded draws are counter-based: the noise of a draw is a function of (seed, sample index,
position) alone, not of a generator's history, so a seeded request's tokens do not depend on
what else is in the batch, on preemption, on a failed step retried, or on which worker
process runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import Logprob


@dataclass
class SampleRow:
    """One draw: which logits row, with which params, for which sequence."""

    logits_row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None  # this draw's own seed (see draw_seed); None: the global generator


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """The seed of one draw: a splitmix64-style mix of the request's seed, which of its n
    samples is drawing, and the position of the token drawn."""
    x = (seed * 0x9E3779B97F4A7C15 + (sample_index + 1) * 0xBF58476D1CE4E5B9
         + (position + 1) * 0x94D049BB133111EB) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    if not rows:
        return SampleResult([], [])
    index = torch.tensor([r.logits_row for r in rows], device=logits.device)
    logits = logits.index_select(0, index).float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if any(r.params.has_penalties for r in rows):
        logits = _apply_penalties(logits, rows)
    logits = _mask_min_tokens(logits, rows)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sel = torch.tensor(random_rows, device=logits.device)
        drawn = _draw(logits.index_select(0, sel), [rows[i] for i in random_rows])
        tokens.index_copy_(0, sel, drawn)
    return SampleResult(tokens.tolist(), _gather_logprobs(raw_logprobs, tokens, rows))


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    n, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros(n, vocab, device=dev)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=dev)
            counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            seen[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
    seen |= counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev).unsqueeze(1)
    # Repetition penalty (HF/CTRL): shrink seen tokens' logits towards "less likely".
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    # OpenAI-style frequency/presence penalties over generated tokens.
    return logits - freq * counts - pres * (counts > 0).float()


def _mask_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens and r.params.min_tokens_stop_ids:
            logits[i, r.params.min_tokens_stop_ids] = float("-inf")
    return logits


def _draw(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    dev = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    logits = logits / temperature
    top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p. Per-row noise
    # lets a seeded row use its own generator.
    noise = torch.empty_like(probs).exponential_()
    generator = None
    for i, r in enumerate(rows):
        if r.seed is not None:
            if generator is None:
                generator = torch.Generator(dev)
            noise[i].exponential_(generator=generator.manual_seed(r.seed))
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop |= before >= top_p.unsqueeze(1)  # keep the smallest prefix reaching top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]
                     ) -> list[dict[int, Logprob]]:
    chosen = raw.gather(1, tokens.unsqueeze(1))
    ranks = (raw > chosen).sum(dim=-1) + 1
    max_n = max(r.params.logprobs or 0 for r in rows)
    top_vals = top_ids = None
    if max_n:
        top_vals, top_ids = raw.topk(max_n, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen_l, ranks_l, tokens_l = chosen.squeeze(1).tolist(), ranks.tolist(), tokens.tolist()
    out = []
    for i, r in enumerate(rows):
        entry = {tokens_l[i]: Logprob(chosen_l[i], ranks_l[i])}
        for j in range(r.params.logprobs or 0):
            tid = top_ids[i][j]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[i][j], j + 1)
        out.append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], n: int
                    ) -> list[dict[int, Logprob]]:
    """For each row, the logprob and rank of the next prompt token plus the top-n."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, device=raw.device)
    chosen = raw.gather(1, tgt.unsqueeze(1))
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    top_vals, top_ids = (raw.topk(n, dim=-1) if n else (None, None))
    out = []
    for i, t in enumerate(targets):
        entry = {t: Logprob(chosen_l[i], ranks[i])}
        for j in range(n):
            tid = int(top_ids[i, j])
            if tid not in entry:
                entry[tid] = Logprob(float(top_vals[i, j]), j + 1)
        out.append(entry)
    return out
