"""StructuredOutputManager: the engine's side of structured outputs (vLLM v1's split: grammar
state beside the scheduler, masks applied where the sampler runs).

How: add_request parses the constraint (a malformed one is an InvalidRequestError before
anything is queued) and compiles it on the grammar thread, once per distinct constraint (an
LRU); the request waits in the scheduler until it is ready, delaying no other. Each step
`fill_bitmasks` gives every sampled sequence with a grammar its allowed-token bitmask, which
the sampler applies after the penalties; `accept` advances its matcher per token.
What fails: a matcher is a function of the output tokens alone (rebuilt by replay), so
failed steps, preemption, restarts and forks need no repair. A grammar that fails to compile
ends its request with finish_reason "error"; a refused token (a mask not applied) "abort".
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fleetllm.errors import InvalidRequestError
from fleetllm.sampling_params import StructuredOutputsParams
from fleetllm.sequence import Sequence, SequenceGroupMetadata
from fleetllm.structured_outputs.backends import Matcher, make_backend

logger = logging.getLogger(__name__)
_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens of KB)


class Grammar:
    """A request's compiled constraint: `future` resolves to (backend, compiled)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    @property
    def ready(self) -> bool:
        return self.future.done()

    def error(self) -> str | None:
        exc = self.future.exception() if self.future.done() else None
        return None if exc is None else str(exc)

    def matcher(self) -> Matcher:
        backend, compiled = self.future.result()
        return backend.matcher(compiled)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 backend: str = "auto") -> None:
        self.backend_name = backend
        self.vocab_size = vocab_size
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._backends: dict[str, Any] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.words = (vocab_size + 31) // 32
        self._special: torch.Tensor | None = None

    def _no_special_tokens(self) -> torch.Tensor:
        """Packed mask without the tokenizer's special tokens (but its EOS): a grammar is
        text, and xgrammar reads a special token as its literal text ("<s>" matching "."),
        which the output then drops (skip_special_tokens) and no longer matches."""
        if self._special is None:
            tokenizer, vocab, eos = self._args
            special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                       if getattr(t, "special", False)}
            special |= set(getattr(tokenizer, "all_special_ids", []))
            allowed = torch.ones(self.words * 32, dtype=torch.bool)
            allowed[[i for i in special if i not in eos and 0 <= i < vocab]] = False
            shifts = torch.arange(32, dtype=torch.int64)
            packed = (allowed.view(self.words, 32).long() << shifts).sum(dim=1)
            self._special = packed.to(torch.int32)  # wraps: bit 31 is the sign bit
        return self._special

    def _backend(self, name: str) -> Any:
        if name not in self._backends:
            self._backends[name] = make_backend(name, *self._args)
        return self._backends[name]

    def _parse(self, params: StructuredOutputsParams) -> tuple[Any, Any]:
        if self.backend_name != "auto":
            backend = self._backend(self.backend_name)
            return backend, backend.parse(params)
        try:
            backend = self._backend("xgrammar")
            return backend, backend.parse(params)
        except InvalidRequestError as first:
            try:  # a feature xgrammar lacks may be one guidance has (vLLM's auto does this)
                backend = self._backend("guidance")
                return backend, backend.parse(params)
            except InvalidRequestError:
                raise first from None

    def prepare(self, params: StructuredOutputsParams) -> Grammar:
        """Parse now (raises InvalidRequestError naming the problem); compile in the grammar
        thread, once per distinct constraint."""
        if self._args[0] is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer; this "
                                      "model has none")
        if not self._args[2]:
            raise InvalidRequestError("structured outputs need an end-of-sequence token to "
                                      "finish on; this model's tokenizer and configs have none")
        key = (self.backend_name, params.key())
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return Grammar(future)
        try:
            backend, parsed = self._parse(params)
        except InvalidRequestError as e:  # led by the field at fault: a server's 400 names it
            raise InvalidRequestError(f"structured_outputs: {e.args[0]}") from None
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="fleetllm-grammar")
            future = self._pool.submit(lambda: (backend, backend.compile(parsed)))
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return Grammar(future)

    # ------------------------------------------------------------------ per step

    def _synced(self, seq: Sequence, grammar: Grammar) -> Matcher | None:
        """The sequence's matcher, advanced over its output tokens. None: the history holds
        a token the grammar refuses."""
        state = seq.grammar_state
        out = seq.output_token_ids
        if state is None or state[1] > len(out):
            state = seq.grammar_state = [grammar.matcher(), 0]
        matcher = state[0]
        while state[1] < len(out):
            if not matcher.accept(out[state[1]]):
                return None
            state[1] += 1
        return matcher

    def fill_bitmasks(self, metadata: list[SequenceGroupMetadata],
                      seqs_by_id: dict[int, Sequence], grammars: dict[str, Grammar]) -> None:
        """Attach each sampled grammar sequence's allowed tokens to its group's metadata."""
        for md in metadata:
            grammar = grammars.get(md.request_id)
            if grammar is None or not md.do_sample:
                continue
            bitmask = torch.full((len(md.seq_data), self.words), -1, dtype=torch.int32)
            for row, seq_id in enumerate(md.seq_data):
                matcher = self._synced(seqs_by_id[seq_id], grammar)
                if matcher is not None:  # else: left open; accept() ends the sequence
                    matcher.fill(bitmask, row)
            md.grammar_bitmask = bitmask & self._no_special_tokens()

    def accept(self, seq: Sequence, grammar: Grammar) -> str | None:
        """After a token was appended: "end" if the grammar is complete, "refused" if the
        token breaks it, else None."""
        matcher = self._synced(seq, grammar)
        if matcher is None:
            logger.warning("sequence %d: token %d is not allowed by its grammar", seq.seq_id,
                           seq.output_token_ids[-1])
            return "refused"
        return "end" if matcher.terminated else None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
