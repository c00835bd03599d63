"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

step(): Scheduler.schedule() -> ExecuteModelRequest -> executor.execute_model -> append
sampled tokens, fork n>1 samples, detokenize, check stop conditions (output_processing.py)
-> RequestOutputs.
A pooling model (task "embed") takes PoolingParams instead: each request runs its prompt in
one step and finishes with its vector (PoolingRequestOutput).
With kv_transfer_config, the connector's scheduler half is built (and checked) before any
worker starts; each step's merged KVConnectorOutput goes back to it, and requests whose KV
load failed are taken out of the step (Scheduler.drop_failed_loads) before it is applied.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from fleetllm import fast_paths
from fleetllm.config import EngineConfig, read_json
from fleetllm.core.scheduler import Scheduler, SchedulerOutputs
from fleetllm.engine.detokenizer import Detokenizer
from fleetllm.engine.expert_load import ExpertLoad
from fleetllm.engine.lora_requests import LoRAMixin, LoRARequests
from fleetllm.engine.output_processing import Output, OutputsMixin
from fleetllm.engine.outputs import RequestOutput, request_output
from fleetllm.engine.recovery import RecoveryMixin, RestartBudget
from fleetllm.engine.request_checks import PromptType, RequestChecksMixin
from fleetllm.engine.tokenizer import load_tokenizer
from fleetllm.errors import (
    CommunicationTimeoutError,
    EngineSleepingError,
    InvalidRequestError,
)
from fleetllm.executor import Executor
from fleetllm.kv_transfer.base import KVConnectorRole
from fleetllm.kv_transfer.factory import create_connector
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import (
    ExecuteModelRequest,
    SamplerOutput,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
)
from fleetllm.spec_decode.metrics import SpecDecodeWorkerMetrics
from fleetllm.structured_outputs.manager import Grammar, StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine(RequestChecksMixin, RecoveryMixin, LoRAMixin, OutputsMixin):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.model_config.arch.vocab_size, self.eos_token_ids,
            config.decoding_config.structured_outputs_backend)
        # Before any worker starts: a bad connector name or setting raises here.
        kv_connector = create_connector(config, KVConnectorRole.SCHEDULER)
        self.model_executor: Executor = Executor.get_class(config)(config)
        try:
            num_gpu, num_cpu = self.model_executor.determine_num_available_blocks()
            self.model_executor.initialize_cache(num_gpu, num_cpu)
        except BaseException:
            self.model_executor.shutdown()
            raise
        kt = config.kv_transfer_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.lora_config, kv_connector,
                                   kt.kv_load_failure_policy if kt else "recompute")
        self.lora_requests = LoRARequests(config)
        # MoE models: tokens routed to each expert, read from the workers when asked
        self._expert_load = ExpertLoad(self.model_executor, config.model_config.arch.num_experts)
        self.seq_groups: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        # Ended since the workers last heard: they drop per-request state for these ids.
        self._finished_since_last_step: list[str] = []
        self._unreported: list[SequenceGroup] = []  # ended without a step; reported next
        # add_request/abort_request may come from another thread while step() runs: they are
        # applied when the step ends, never in the middle of one.
        self._lock = threading.Lock()
        self._stepping = False
        self._deferred_adds: list[SequenceGroup] = []
        self._deferred_aborts: list[str] = []
        # Workers replaced after a crash or hang: max_worker_restarts per window
        # (worker_restart_window_s); its total is self.worker_restarts.
        pc = config.parallel_config
        self.restart_budget = RestartBudget(pc.max_worker_restarts, pc.worker_restart_window_s)
        # The executor's kv_cache_epoch when this engine last knew the workers' KV content.
        self._kv_epoch = self.model_executor.kv_cache_epoch
        # Good steps since an out-of-memory step halved the token budget, which stays halved
        # until OOM_FORGET_STEPS of them (None: no such step, the budget may grow back).
        self._steps_since_oom: int | None = None

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model=model, **kwargs))

    def _eos_token_ids(self) -> list[int]:
        ids = list(self.model_config.arch.eos_token_ids)
        gen_cfg = Path(self.model_config.model) / "generation_config.json"
        if gen_cfg.exists():
            eos = read_json(gen_cfg).get("eos_token_id")
            ids += [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ----------------------------------------------------------------- requests in

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request: SamplingParams to generate, PoolingParams for a pooling model;
        `lora_request` runs it with that LoRA adapter (enable_lora). Raises
        InvalidRequestError (and queues nothing) if it can never be served; a bad adapter is
        a LoRAAdapterError, an InvalidRequestError."""
        salt = self.lora_requests.check(lora_request)
        text, token_ids = self._tokenize(prompt)
        pooling = self._pooling_params(params)
        if pooling is not None:
            self._validate_pooling(token_ids, pooling)
            params = SamplingParams(max_tokens=1)  # the scheduler's view: one sequence
        else:
            # A copy: the caller's SamplingParams may serve other requests (and models).
            params = dataclasses.replace(params or SamplingParams(),
                                         eos_token_ids=self.eos_token_ids)
            self._validate(token_ids, params)
        # Parsed now (a malformed schema is refused here), compiled off the step path.
        grammar = None if params.structured_outputs is None else \
            self.structured_outputs.prepare(params.structured_outputs)
        seq = Sequence(next(self._seq_ids), text, token_ids, salt)
        self.detokenizer.start(seq, params)
        group = SequenceGroup(request_id, [seq], params, arrival_time, pooling, lora_request)
        group.grammar = grammar
        with self._lock:
            if request_id in self.seq_groups:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self.seq_groups[request_id] = group
            if self._stepping:
                self._deferred_adds.append(group)
            else:
                self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests and free their blocks. No output for them is returned after this
        call returns (an abort that lands while a step runs, from another thread, is applied
        when that step ends and that step's outputs for them are dropped)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            if self._stepping:
                self._deferred_aborts.extend(ids)
                self.interrupt_step()
                return
            self._abort(ids)

    def interrupt_step(self) -> None:
        """With num_scheduler_steps > 1: end the multi-step call under way after its current
        pass (Executor.interrupt_step), so that an abort takes effect within one pass, not k.
        Any thread; no-op otherwise. abort_request calls it; so do the async front ends, whose
        aborts reach the engine only between steps."""
        if self.config.scheduler_config.num_scheduler_steps > 1:
            try:
                self.model_executor.interrupt_step()
            except Exception:  # best effort: the abort itself is applied after the step
                logger.debug("interrupt_step failed", exc_info=True)

    def _abort(self, ids: list[str]) -> None:
        self.scheduler.abort_seq_group(ids)
        for rid in ids:
            if self.seq_groups.pop(rid, None) is not None:
                self._finished_since_last_step.append(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs() or bool(self._unreported)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups() + len(self._unreported)

    # ----------------------------------------------------------------- the loop

    def step(self, finished_only: bool = False) -> list[Output]:
        """Schedule, run and apply one step. Atomic: if the executor raises, no token is
        appended and no output or finished-request notice is lost; the next step computes the
        same chunks again (see Scheduler.requeue_after_failed_step), and the exception
        propagates.

        Returns a RequestOutput for every request that made progress (streaming), or with
        finished_only=True only for requests that finished: building a cumulative output per
        request per step copies its whole history, which an offline caller throws away."""
        with self._lock:
            self._stepping = True
        try:
            outputs = self._step(finished_only)
        finally:
            with self._lock:
                self._stepping = False
                for group in self._deferred_adds:
                    self.scheduler.add_seq_group(group)
                aborted, self._deferred_aborts, self._deferred_adds = \
                    set(self._deferred_aborts), [], []
                if aborted:
                    self._abort(list(aborted))
        return [o for o in outputs if o.request_id not in aborted] if aborted else outputs

    def _step(self, finished_only: bool) -> list[Output]:
        self._sync_kv_epoch()
        metadata, sched = self.scheduler.schedule()
        # Requests that can never be scheduled end here; reported even if the step fails.
        for group in sched.ignored_seq_groups:  # may have run before: workers drop its state
            self.seq_groups.pop(group.request_id, None)
            self._finished_since_last_step.append(group.request_id)
            self._unreported.append(group)
        outputs: list[Output] = []
        if sched.is_empty and self.scheduler.has_unfinished_seqs():
            compiling = self.scheduler.waiting_for_grammars()
            if compiling:  # nothing else to run: wait (briefly) for a grammar, not spin
                wait_futures([g.grammar.future for g in compiling], timeout=0.05,
                             return_when=FIRST_COMPLETED)
            else:
                self._widen_token_budget()
        if not sched.is_empty:
            self._fill_grammar_bitmasks(metadata, sched)
            finished_ids = list(self._finished_since_last_step)
            request = ExecuteModelRequest(
                metadata, blocks_to_swap_in=sched.blocks_to_swap_in,
                blocks_to_swap_out=sched.blocks_to_swap_out,
                blocks_to_copy=sched.blocks_to_copy, running_queue_size=sched.running_queue_size,
                finished_requests_ids=finished_ids,
                num_lookahead_slots=self.config.scheduler_config.num_lookahead_slots,
                num_steps=self._num_steps(metadata),
                kv_connector_metadata=sched.kv_connector_metadata)
            try:
                results = self._execute(request)
            except BaseException as error:
                self.scheduler.requeue_after_failed_step(sched)
                if not self._recover(sched, error):
                    raise
            else:
                del self._finished_since_last_step[:len(finished_ids)]  # the workers have them
                self._apply_kv_connector_output(sched, results)
                self.scheduler.complete_step(sched)
                self._regrow_token_budget()
                outputs = self._process(sched, results, finished_only)
        outputs += [request_output(g) for g in self._unreported]
        self._unreported = []
        self._finished_since_last_step += self.scheduler.free_finished_seq_groups()
        self._attach_kv_transfer_params(outputs)
        self.model_executor.record_outputs(outputs)  # requests completed / failed (metrics)
        return outputs

    def _apply_kv_connector_output(self, sched: SchedulerOutputs,
                                   results: list[SamplerOutput]) -> None:
        """The step's merged KVConnectorOutput to the connector; requests whose blocks failed
        to load leave the step (their results are dropped) and are recomputed or end with
        an error (kv_load_failure_policy), reported once like ignored requests."""
        connector = self.scheduler.kv_connector
        kv_out = results[-1].kv_connector_output if connector is not None and results else None
        if kv_out is None:
            return
        connector.update_connector_output(kv_out)
        if not kv_out.invalid_block_ids:
            return
        dropped, ended = self.scheduler.drop_failed_loads(sched, kv_out.invalid_block_ids)
        gone = set(dropped)
        for result in results:
            result.outputs = [o for i, o in enumerate(result.outputs) if i not in gone]
        for group in ended:
            self.seq_groups.pop(group.request_id, None)
            self._finished_since_last_step.append(group.request_id)
            self._unreported.append(group)

    def _attach_kv_transfer_params(self, outputs: list[Output]) -> None:
        """The connector's kv_transfer_params of each request that finished (it answers when
        the request's blocks are freed, after its output was built) onto that final output;
        those of requests with no output here (aborted) are dropped."""
        if self.scheduler.kv_connector is None:
            return
        params = self.scheduler.take_kv_transfer_params()
        for out in outputs if params else ():
            if out.finished and out.request_id in params and isinstance(out, RequestOutput):
                out.kv_transfer_params = params[out.request_id]

    @property
    def kv_transfer_stats(self) -> dict[str, int]:
        """KV transfer counters since the start: the connector's (SharedStorageConnector:
        blocks_loaded, tokens_loaded, blocks_saved, and the KV bytes the ranks read and
        wrote: bytes_loaded, bytes_saved), requests whose load failed, and the
        prompt tokens the workers computed (what a store hit saves). {} without one."""
        connector = self.scheduler.kv_connector
        if connector is None:
            return {}
        return {**getattr(connector, "stats", {}),
                "load_failures": self.scheduler.num_kv_load_failures,
                "prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed}

    def _num_steps(self, metadata: list[SequenceGroupMetadata]) -> int:
        """Multi-step decoding (num_scheduler_steps): the workers run several passes only for
        a batch that may (fast_paths.multi_step: decodes, no grammar) with nothing waiting or
        swapped (new requests are admitted at the next step, not k passes later)."""
        k = self.config.scheduler_config.num_scheduler_steps
        if k == 1 or self.scheduler.waiting or self.scheduler.swapped or \
                not fast_paths.multi_step(metadata):
            return 1
        return k

    def _fill_grammar_bitmasks(self, metadata: list[SequenceGroupMetadata],
                               sched: SchedulerOutputs) -> None:
        grammars: dict[str, Grammar] = {}
        seqs = {}
        for scheduled in sched.scheduled_seq_groups:
            group = scheduled.seq_group
            if group.grammar is not None and scheduled.do_sample:
                grammars[group.request_id] = group.grammar
                seqs.update((s.seq_id, s) for s in group.seqs)
        if grammars:
            self.structured_outputs.fill_bitmasks(metadata, seqs, grammars)

    # ----------------------------------------------------------------- recovery

    def _execute(self, request: ExecuteModelRequest) -> list[SamplerOutput]:
        try:
            return self.model_executor.execute_model(request)
        except CommunicationTimeoutError as error:
            if not self.model_executor.step_outstanding:
                raise
            # A step past execute_model_timeout may be slow rather than stuck: wait once
            # more, as long again, for its replies; if they do not come the workers are hung.
            logger.warning("%s; waiting once more", str(error).splitlines()[0])
            return self.model_executor.wait_for_timed_out_step()

    @property
    def spec_decode_metrics(self) -> SpecDecodeWorkerMetrics | None:
        """Speculative decoding's counts since the start (the executor sums every step's);
        None while no step has speculated."""
        return self.model_executor.metrics.spec_decode

    def expert_load(self) -> dict[int, list[int]]:
        """A mixture-of-experts model's load: {MoE layer index: (token, expert) pairs routed
        to each expert since the engine started} ({} for a dense model). Reads the workers'
        counts now (engine/expert_load.py); call it between steps."""
        self._expert_load.pull()
        return self._expert_load.counts()

    def expert_load_imbalance(self, every_s: float = 1.0) -> dict[int, float]:
        """{MoE layer: max / mean pairs per expert} since the start, the workers' counts read
        at most once every `every_s` seconds (the server's per-step snapshot)."""
        self._expert_load.refresh(every_s)
        return self._expert_load.imbalance()

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.model_executor.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Executor.sleep: free the KV cache (level 1) or the KV cache and weights (level 2)
        until wake_up(). Refused while requests are in flight (their KV cache would go);
        requests added while asleep wait, and step() raises EngineSleepingError. A worker
        that died is replaced (it is put to sleep like the others)."""
        if not self.model_executor.is_sleeping and self.has_unfinished_requests():
            raise EngineSleepingError(f"sleep: {self.get_num_unfinished_requests()} requests "
                                      "are in flight; finish or abort them first")
        self._expert_load.pull()  # level 2 drops the workers' counts with the weights
        self._recovering(lambda: self.model_executor.sleep(level))
        self._sync_kv_epoch()  # the cached KV is gone with it

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Executor.wake_up: restore "weights", "kv_cache" or both (None). Workers that died
        while asleep are replaced first (max_worker_restarts), then woken."""
        self._recovering(lambda: self.model_executor.wake_up(tags))
