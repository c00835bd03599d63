"""How LLMEngine recovers when its workers fail, wherever it is found (a step, the idle health
probe, sleep, wake_up): crashed or hung workers are replaced (within max_worker_restarts per
worker_restart_window_s: RestartBudget) and every request is recomputed; a step out of memory
is retried with half its tokens, the budget staying halved for OOM_FORGET_STEPS good steps.
Whenever the workers' KV content is gone (kv_cache_epoch moved) cached prefixes are forgotten
and running requests recomputed. resume_samples gives a re-added request the tokens a dead
engine core had made. A mixin of LLMEngine, kept apart so the request path reads on its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleetllm.engine.detokenizer import held_back_length
from fleetllm.errors import CommunicationTimeoutError, WorkerCrashedError
from fleetllm.sequence import SequenceStatus

if TYPE_CHECKING:
    from fleetllm.core.scheduler import SchedulerOutputs

logger = logging.getLogger(__name__)
# After an out-of-memory step, the halved budget is kept for this many good steps.
OOM_FORGET_STEPS = 1000


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds (math.inf: over its whole
    life). A restart older than the window is forgotten: a server that runs for weeks
    survives unrelated crashes months apart, while a crash loop (a request that crashes
    every worker it reaches, a device gone) exhausts the limit in seconds and gives up.
    `clock` is injectable for tests. Not thread-safe: one owner (the engine's step loop, or
    whatever restarts an engine core) calls it."""

    def __init__(self, limit: int, window_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.total = 0  # every restart ever taken (metrics)
        self._times: deque[float] = deque()  # when the restarts still in the window were

    def in_window(self) -> int:
        """Restarts that still count against the limit."""
        now = self.clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        return len(self._times)

    def take(self) -> bool:
        """Count one restart if the limit allows it (True), else change nothing (False)."""
        if self.in_window() >= self.limit:
            return False
        self._times.append(self.clock())
        self.total += 1
        return True

    def reset(self, total: int = 0) -> None:
        """Start over with `total` restarts, all counted as of now (0: the full budget)."""
        now = self.clock()
        self.total = total
        self._times = deque(now for _ in range(min(total, self.limit)))


class RecoveryMixin:
    @property
    def worker_restarts(self) -> int:
        """Workers replaced after a crash or hang, since the start (metrics)."""
        return self.restart_budget.total

    @worker_restarts.setter
    def worker_restarts(self, value: int) -> None:
        """Set the count; the budget then holds that many restarts as of now (0: full)."""
        self.restart_budget.reset(value)

    def _recover(self, sched: SchedulerOutputs, error: BaseException) -> bool:
        """After a failed step (already requeued): can the engine carry on? Workers that
        crashed or hung are replaced and every request resumes; a step out of memory is
        retried smaller (also when, under TP/PP, it failed the workers: they are replaced
        and the step shrinks too, or it would fail again). Anything else propagates."""
        oom = out_of_memory_cause(error)
        if isinstance(error, WorkerCrashedError | CommunicationTimeoutError):
            if not self._restart_workers(error):
                return False
        elif oom is None:
            return False
        if oom is not None:
            self._shrink_token_budget(sched, oom)
        return True

    def check_health(self, timeout: float = 10.0) -> None:
        """Executor.check_health, recovered from as a failed step is: workers found dead or
        hung while the engine is idle (or asleep) are replaced, within max_worker_restarts,
        and every request resumes. Raises only what cannot be recovered."""
        try:
            self.model_executor.check_health(timeout)
        except (WorkerCrashedError, CommunicationTimeoutError) as error:
            if not self._restart_workers(error):
                raise

    def _restart_workers(self, error: BaseException) -> bool:
        """Replace the workers (Executor.restart_failed_workers) and recompute every request.
        A restart that fails counts as one and is tried again, after a short pause, until
        max_worker_restarts within worker_restart_window_s is reached: then False (the
        caller raises)."""
        budget, pc = self.restart_budget, self.config.parallel_config
        while True:
            if not budget.take():
                logger.error("workers failed again after %d restarts within %ss "
                             "(max_worker_restarts=%d, worker_restart_window_s): giving up: %s",
                             budget.in_window(), pc.worker_restart_window_s, budget.limit,
                             error)
                return False
            logger.warning("workers failed (%s); restarting them (%d of %d within %ss, %d in "
                           "all) and resuming %d requests", str(error).splitlines()[0],
                           budget.in_window(), budget.limit, pc.worker_restart_window_s,
                           budget.total, len(self.seq_groups))
            try:
                self.model_executor.restart_failed_workers()
                break
            except WorkerCrashedError as restart_error:
                error = restart_error
                time.sleep(min(2.0, 0.25 * budget.in_window()))
        # The new workers hold no KV blocks and no per-request state: every request is
        # recomputed from its prompt and the tokens it has (seeded draws are counter-based,
        # so they continue exactly).
        self._sync_kv_epoch()
        self._finished_since_last_step.clear()
        return True

    def _sync_kv_epoch(self) -> None:
        """The workers' KV cache lost its content since this engine last looked (a restart,
        or sleep() called on the executor itself): forget the cached prefixes and recompute
        the requests that had KV there, instead of reading blocks that are gone."""
        epoch = self.model_executor.kv_cache_epoch
        if epoch != self._kv_epoch:
            self._kv_epoch = epoch
            self.scheduler.recompute_all()

    def _shrink_token_budget(self, sched: SchedulerOutputs, error: BaseException) -> None:
        """Out of memory in a step: retry with half its tokens, and keep that budget (for
        OOM_FORGET_STEPS good steps: memory may come back) rather than grow it back into the
        size that failed: every step past a real memory limit would fail again. A request
        that ran alone at its smallest step (one token per sequence) cannot fit: it fails."""
        groups = [s.seq_group for s in sched.scheduled_seq_groups]
        smallest = max((len(g.unfinished_seqs()) for g in groups), default=1)
        if len(groups) == 1 and sched.num_batched_tokens <= smallest:
            self.scheduler.fail_group(groups[0], f"out of memory even alone in a step of "
                                      f"{sched.num_batched_tokens} tokens: {error}")
            self.seq_groups.pop(groups[0].request_id, None)
            self._finished_since_last_step.append(groups[0].request_id)
            self._unreported.append(groups[0])
            return
        budget = max(smallest, sched.num_batched_tokens // 2)
        logger.warning("a step of %d tokens ran out of memory; retrying with at most %d",
                       sched.num_batched_tokens, budget)
        self.scheduler.max_num_batched_tokens = budget
        self._steps_since_oom = 0

    def _widen_token_budget(self) -> None:
        """Nothing could be scheduled with work waiting: a budget halved after an OOM may be
        narrower than a group's sequences (n samples decode together). Double it, up to
        the configured one, rather than wait for ever."""
        full = self.config.scheduler_config.max_num_batched_tokens
        if self.scheduler.max_num_batched_tokens < full:
            self.scheduler.max_num_batched_tokens = min(
                full, 2 * self.scheduler.max_num_batched_tokens)

    def _regrow_token_budget(self) -> None:
        """After a good step: OOM_FORGET_STEPS good steps after an out-of-memory step, the
        budget doubles back to the configured one, a step at a time (an OOM on the way
        halves it again and restarts the count)."""
        if self._steps_since_oom is not None:
            self._steps_since_oom += 1
            if self._steps_since_oom < OOM_FORGET_STEPS:
                return
            self._steps_since_oom = None
        full = self.config.scheduler_config.max_num_batched_tokens
        if self.scheduler.max_num_batched_tokens < full:
            self.scheduler.max_num_batched_tokens = min(
                full, 2 * self.scheduler.max_num_batched_tokens)

    def _recovering(self, call: Callable[[], None]) -> None:
        """Run a call to the workers outside a step; if they crashed or hung, restart them
        (as a failed step would) and run it again."""
        try:
            call()
        except (WorkerCrashedError, CommunicationTimeoutError) as error:
            if not self._restart_workers(error):
                raise
            call()


def resume_samples(engine: Any, request_id: str, samples: list[list[Any]]) -> None:
    """Give a just-added request (LLMEngine.add_request, not yet scheduled) the sequences
    another engine had made for it: a dead engine core's, as its API process saw them
    (core_client). `samples`: [index, output token ids, output text, cumulative logprob,
    finish reason | None, stop reason] per sequence, in index order. They wait to be
    recomputed from their tokens, exactly as after a worker restart (recompute_all): the
    next token is drawn at the same position with the same sample index, so greedy and
    seeded requests continue with the tokens the dead core would have given; min/max_tokens,
    penalties and a grammar see the tokens already made."""
    group = engine.seq_groups[request_id]
    params = group.sampling_params
    first = group.seqs[0]  # no output yet: each sample starts from a copy of it
    seqs = [first if index == 0 else first.fork(next(engine._seq_ids), sample_index=index)
            for index, *_ in samples]
    for seq, (index, tokens, text, cumulative, finish, stop_reason) in zip(seqs, samples,
                                                                           strict=True):
        seq.data.sample_index = index
        for token in tokens:
            seq.append_token(token, {})  # no logprobs: those sent already are not sent again
            if finish is None:  # the detokenizer's state (and held-back text) as it was
                engine.detokenizer.decode_new_token(seq, params)
        seq.cumulative_logprob = cumulative
        if finish is None:
            seq.held_back = held_back_length(seq.output_text, params.stop)
        else:  # finished: its text is final, and it is not run again
            seq.output_text, seq.held_back, seq.stop_reason = text, 0, stop_reason
            seq.status = SequenceStatus(finish)
    group.seqs[:] = seqs


def out_of_memory_cause(error: BaseException) -> BaseException | None:
    """The out-of-memory error that `error` is or was caused by (a worker's OOM inside a
    collective fails the executor: it arrives as the __cause__ of a WorkerCrashedError)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, MemoryError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return None
