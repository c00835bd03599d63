"""The sampler: logits -> next tokens and their logprobs, vectorized over the batch.

Order per row: penalties (repetition, frequency, presence; PenaltyState's incremental
per-sequence counts), min_tokens masking, the grammar's bitmask (structured outputs), then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw (top-k/top-p over a
torch.topk candidate set, not a sorted vocabulary). Logprobs are the raw model distribution's
(before penalties and temperature), as vLLM reports them, and only for rows that ask.
Seeded draws are counter-based: a draw's noise is a function of (seed, sample index,
position) alone, so a seeded request's tokens do not depend on the rest of the batch,
preemption, a retried step or which worker process runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetllm.kernels import cpu_kernels
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
    seq_id: int | None = None  # keys the incremental penalty state; None: from the history
    # Structured outputs: the tokens allowed next, packed int32 [ceil(vocab / 32)]
    # (bit j of word i: token 32 * i + j); None: no constraint.
    allowed: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]  # empty for rows that asked for no logprobs


_MASK64 = (1 << 64) - 1
# Top-p without top-k looks for its nucleus among this many likeliest tokens first; a row
# whose nucleus is wider falls back to sorting the whole vocabulary.
_TOP_P_CANDIDATES = 256


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """The seed of one draw: a splitmix64-style mix of the request's seed, which of its n
    samples is drawing, and the position of the token drawn."""
    x = (seed * 0x9E3779B97F4A7C15 + (sample_index + 1) * 0xBF58476D1CE4E5B9
         + (position + 1) * 0x94D049BB133111EB) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


class PenaltyState:
    """Per sequence, the output-token counts (and, for a repetition penalty, the set of
    prompt tokens) as dense [vocab] tensors, updated with each step's new tokens only: a step
    costs O(vocab) vectorized per penalized row, never a walk over its history. Entries are
    dropped with their request (`drop`); a sequence seen for the first time (a new request, a
    fork, a worker that joined late) is built from its history once."""

    def __init__(self) -> None:
        # seq_id -> [request_id, tokens counted, counts, prompt mask or None]
        self.entries: dict[int, list] = {}
        self.by_request: dict[str, set[int]] = {}

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for seq_id in self.by_request.pop(rid, ()):
                self.entries.pop(seq_id, None)

    def tensors(self, row: SampleRow, request_id: str | None, vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = row.output_token_ids
        entry = self.entries.get(row.seq_id) if row.seq_id is not None else None
        if entry is None or entry[1] > len(out) or (request_id is not None
                                                    and entry[0] != request_id):
            entry = [request_id, 0, torch.zeros(vocab, device=device), None]
            if row.seq_id is not None:
                self.entries[row.seq_id] = entry
                if request_id is not None:
                    self.by_request.setdefault(request_id, set()).add(row.seq_id)
        if entry[1] < len(out):
            new = torch.tensor(out[entry[1]:], device=device)
            entry[2].index_add_(0, new, torch.ones(len(new), device=device))
            entry[1] = len(out)
        if row.params.repetition_penalty != 1.0 and entry[3] is None:
            entry[3] = torch.zeros(vocab, dtype=torch.bool, device=device)
            if row.prompt_token_ids:
                entry[3][torch.tensor(row.prompt_token_ids, device=device)] = True
        return entry[2], entry[3]


def sample(logits: torch.Tensor, rows: list[SampleRow], state: PenaltyState | None = None,
           request_ids: list[str] | None = None) -> SampleResult:
    """request_ids: per row, its request (for `state`'s bookkeeping)."""
    if not rows:
        return SampleResult([], [])
    dev = logits.device
    index = [r.logits_row for r in rows]
    if index != list(range(logits.shape[0])):
        logits = logits.index_select(0, torch.tensor(index, device=dev))
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    # Greedy rows without penalties or logprobs need only each row's argmax, which the model's
    # own dtype gives as well: no float32 copy of the logits.
    if penalized or any(not r.params.greedy or r.params.logprobs is not None for r in rows):
        logits = logits.float()
    raw = logits
    if penalized:
        logits = _apply_penalties(logits, rows, penalized, state or PenaltyState(),
                                  request_ids)
    before_min_tokens = logits
    logits = _mask_grammar(_mask_min_tokens(logits, rows, raw), rows, before_min_tokens)
    tokens = argmax(logits)  # greedy rows need nothing else
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sel = torch.tensor(random_rows, device=dev)
        drawn = _draw(logits.index_select(0, sel), [rows[i] for i in random_rows])
        tokens.index_copy_(0, sel, drawn)
    token_list = tokens.tolist()
    return SampleResult(token_list, _gather_logprobs(raw, token_list, rows))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D x: the C kernel on the CPU (torch's CPU argmax takes ~1 ns an
    element, 29 us for a 32K vocabulary; the kernel 3.5), the same indices."""
    if x.dim() == 2 and x.shape[1] and cpu_kernels.usable(x):
        return cpu_kernels.argmax(x)
    return x.argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], which: list[int],
                     state: PenaltyState, request_ids: list[str] | None) -> torch.Tensor:
    vocab, dev = logits.shape[1], logits.device
    counts, seen = [], []
    for i in which:
        c, prompt_mask = state.tensors(rows[i], request_ids[i] if request_ids else None,
                                       vocab, dev)
        counts.append(c)
        seen.append(c > 0 if prompt_mask is None else prompt_mask | (c > 0))
    counts_t, seen_t = torch.stack(counts), torch.stack(seen)
    params = [rows[i].params for i in which]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
    sub = logits.index_select(0, torch.tensor(which, device=dev))
    # Repetition penalty (HF/CTRL): shrink seen tokens' logits towards "less likely".
    sub = torch.where(seen_t, torch.where(sub > 0, sub / rep, sub * rep), sub)
    # OpenAI-style frequency/presence penalties over generated tokens.
    sub = sub - freq * counts_t - pres * (counts_t > 0).float()
    logits = logits.clone()
    logits[which] = sub
    return logits


def _mask_min_tokens(logits: torch.Tensor, rows: list[SampleRow], raw: torch.Tensor
                     ) -> torch.Tensor:
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens and r.params.min_tokens_stop_ids:
            if logits is raw:  # raw stays the model's distribution for reported logprobs
                logits = logits.clone()
            logits[i, r.params.min_tokens_stop_ids] = float("-inf")
    return logits


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 [..., words] -> bool [..., vocab] (tokens past the words: not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)
    if bits.shape[-1] >= vocab:
        return bits[..., :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[-1]))


def _mask_grammar(logits: torch.Tensor, rows: list[SampleRow], before_min_tokens: torch.Tensor
                  ) -> torch.Tensor:
    """-inf for the tokens a row's grammar does not allow. A row left with nothing (its
    grammar allows only an EOS that min_tokens forbids) keeps the grammar's mask alone: the
    grammar wins, as the output must parse."""
    which = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not which:
        return logits
    dev = logits.device
    sel = torch.tensor(which, device=dev)
    allowed = unpack_bitmask(torch.stack([rows[i].allowed for i in which]).to(dev),
                             logits.shape[1])
    sub = logits.index_select(0, sel).masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(sub).all(dim=-1)
    if bool(dead.any()):
        fallback = before_min_tokens.index_select(0, sel).masked_fill(~allowed, float("-inf"))
        sub = torch.where(dead.unsqueeze(1), fallback, sub)
    return logits.index_copy(0, sel, sub)


def exponential_noise(shape: tuple[int, ...] | int, dev: torch.device,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise as -log(U), U ~ Uniform[0, 1). torch's CPU exponential_() costs ~20 ns an
    element (30 ms for 48 rows of a 32K vocabulary, as much as the decode step's model
    forward); uniform draws and a log cost a sixth of that. U = 0 gives +inf: that token
    loses the race, as it should with probability 2^-24."""
    return torch.rand(shape, device=dev, generator=generator).log_().neg_()


def _noise(rows: list[SampleRow], vocab: int, dev: torch.device,
           candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Exponential-race noise, one row per draw: over the whole vocabulary, or read at each
    row's candidates [n, k]. A seeded row always draws its whole-vocabulary noise from its
    own generator, so its token does not depend on how many candidates were kept."""
    width = vocab if candidates is None else candidates.shape[1]
    noise = exponential_noise((len(rows), width), dev)
    generator = None
    for i, r in enumerate(rows):
        if r.seed is None:
            continue
        if generator is None:
            generator = torch.Generator(dev)
        generator.manual_seed(r.seed)
        full = exponential_noise(vocab, dev, generator)
        noise[i] = full if candidates is None else full.index_select(0, candidates[i])
    return noise


def _draw(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p -> an exponential-race draw (argmax p / E with
    E ~ Exp(1) draws from p). Rows with top-k or top-p work on their candidates only."""
    dev, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    logits = logits / temperature
    truncated = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1]
    full = [i for i in range(len(rows)) if i not in set(truncated)]
    tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
    if full:
        sel = torch.tensor(full, device=dev)
        sub_rows = [rows[i] for i in full]
        probs = _min_p(torch.softmax(logits.index_select(0, sel), dim=-1), sub_rows)
        tokens.index_copy_(0, sel, argmax(probs / _noise(sub_rows, vocab, dev)))
    if truncated:
        sel = torch.tensor(truncated, device=dev)
        tokens.index_copy_(0, sel, _draw_truncated(logits.index_select(0, sel),
                                                   [rows[i] for i in truncated]))
    return tokens


def _min_p(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    min_p = torch.tensor([r.params.min_p for r in rows], device=probs.device).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _draw_truncated(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Top-k / top-p among the k likeliest tokens (k = top_k, or _TOP_P_CANDIDATES for top-p
    alone) instead of sorting the vocabulary. Top-p alone is exact when the candidates hold
    the nucleus (their mass, normalized over the whole vocabulary, reaches top_p); rows where
    they do not are drawn over the sorted vocabulary instead."""
    dev, vocab = logits.device, logits.shape[1]
    top_k = [min(vocab, r.params.top_k if r.params.top_k > 0 else _TOP_P_CANDIDATES)
             for r in rows]
    values, cand = logits.topk(max(top_k), dim=-1)  # sorted, descending
    k = torch.tensor(top_k, device=dev).unsqueeze(1)
    ranks = torch.arange(values.shape[1], device=dev).unsqueeze(0)
    values = values.masked_fill(ranks >= k, float("-inf"))
    has_k = torch.tensor([r.params.top_k > 0 for r in rows], device=dev).unsqueeze(1)
    # top-p's distribution: renormalized after top-k, else over the whole vocabulary
    norm = torch.where(has_k, torch.logsumexp(values, dim=-1, keepdim=True),
                       torch.logsumexp(logits, dim=-1, keepdim=True))
    probs = torch.exp(values - norm)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev).unsqueeze(1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each candidate
    drop = before >= top_p  # keep the smallest prefix reaching top_p
    drop[:, 0] = False
    tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
    # Top-p alone whose nucleus is wider than the candidates: the whole sorted vocabulary.
    wide = ((~has_k) & (top_p < 1) & ~drop[:, -1:]).squeeze(1)
    if _TOP_P_CANDIDATES >= vocab or not bool(wide.any()):
        wide_rows, narrow_rows = [], list(range(len(rows)))
    else:
        wide_rows = wide.nonzero().squeeze(1).tolist()
        narrow_rows = (~wide).nonzero().squeeze(1).tolist()
    if narrow_rows:
        sel = torch.tensor(narrow_rows, device=dev)
        sub = [rows[i] for i in narrow_rows]
        values = values.index_select(0, sel).masked_fill(drop.index_select(0, sel),
                                                         float("-inf"))
        probs = _min_p(torch.softmax(values, dim=-1), sub)
        cand_sel = cand.index_select(0, sel)
        pick = (probs / _noise(sub, vocab, dev, cand_sel)).argmax(dim=-1, keepdim=True)
        tokens.index_copy_(0, sel, cand_sel.gather(1, pick).squeeze(1))
    if wide_rows:
        sel = torch.tensor(wide_rows, device=dev)
        sub = [rows[i] for i in wide_rows]
        sub_logits = _top_p_sorted(logits.index_select(0, sel), top_p.index_select(0, sel))
        probs = _min_p(torch.softmax(sub_logits, dim=-1), sub)
        tokens.index_copy_(0, sel, argmax(probs / _noise(sub, vocab, dev)))
    return tokens


def _top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop = before >= top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _gather_logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SampleRow]
                     ) -> list[dict[int, Logprob]]:
    """The raw distribution's logprob and rank of each drawn token plus the top-n, for the
    rows that asked (logprobs not None); other rows get an empty dict and cost nothing."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[dict[int, Logprob]] = [{} for _ in rows]
    if not want:
        return out
    dev = raw.device
    lp = torch.log_softmax(raw.index_select(0, torch.tensor(want, device=dev)), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=dev).unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen_l = chosen.squeeze(1).tolist()
    max_n = max(rows[i].params.logprobs for i in want)
    top_vals = top_ids = None
    if max_n:
        top_vals, top_ids = (t.tolist() for t in lp.topk(max_n, dim=-1))
    for j, i in enumerate(want):
        entry = {tokens[i]: Logprob(chosen_l[j], ranks[j])}
        for n in range(rows[i].params.logprobs):
            tid = top_ids[j][n]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[j][n], n + 1)
        out[i] = entry
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
