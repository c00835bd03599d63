"""Applying a step's SamplerOutputs to the engine's sequences (LLMEngine's OutputsMixin):
append each sampled token, fork n > 1 samples from a fresh prompt's step, detokenize, check
the stop conditions (EOS and stop tokens, stop strings, max_tokens, max_model_len, a
structured output's grammar), free what finished, and build the RequestOutputs.

A step's results[0] holds every group's first token; results[1:] (speculative decoding's
accepted drafts, multi-step decoding's later passes) the tokens after it, in order. A pooling
group's output is its vector: it finishes in the step that computed it.
"""

from __future__ import annotations

import time
from typing import Any

from fleetllm.core.scheduler import SchedulerOutputs
from fleetllm.engine.detokenizer import find_stop_string, held_back_length
from fleetllm.engine.outputs import PoolingRequestOutput, RequestOutput
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import (
    PoolingSequenceGroupOutput,
    SamplerOutput,
    Sequence,
    SequenceGroup,
    SequenceOutput,
    SequenceStatus,
)
from fleetllm.structured_outputs.manager import Grammar

Output = RequestOutput | PoolingRequestOutput


class OutputsMixin:
    """Needs: scheduler, detokenizer, structured_outputs, seq_groups, model_config,
    _seq_ids (LLMEngine's)."""

    scheduler: Any
    detokenizer: Any
    structured_outputs: Any
    seq_groups: dict[str, SequenceGroup]
    model_config: Any
    _seq_ids: Any

    def _process(self, sched: SchedulerOutputs, results: list[SamplerOutput],
                 finished_only: bool) -> list[Output]:
        """Apply a step's outputs: results[0] has every group's first token, results[1:] the
        further tokens of sequences whose drafts were accepted (speculative decoding) or of
        the later passes (multi-step decoding), in order."""
        now = time.time()
        outputs: list[Output] = []
        for index, (scheduled, group_out) in enumerate(zip(
                sched.scheduled_seq_groups, results[0].outputs, strict=True)):
            group = scheduled.seq_group
            if group.is_finished():  # aborted while the step ran
                continue
            if isinstance(group_out, PoolingSequenceGroupOutput):
                outputs.append(self._finish_pooled(group, group_out, now))
                continue
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            chunk_start = seqs[0].data.num_computed_tokens - scheduled.token_chunk_size
            if group_out.prompt_logprobs is not None and group.prompt_logprobs is not None:
                if chunk_start == 0:  # computed from its first token (again, if preempted)
                    group.prompt_logprobs = list(group_out.prompt_logprobs)
                elif len(group.prompt_logprobs) < len(group.prompt_token_ids):
                    group.prompt_logprobs.extend(group_out.prompt_logprobs)
            if not group_out.samples:
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            self._append_samples(group, group_out.samples)
            for later in results[1:]:
                self._append_accepted(group, later.outputs[index].samples)
            if group.is_finished():
                group.metrics.finished_time = now
                self.seq_groups.pop(group.request_id, None)
            elif finished_only:
                continue
            outputs.append(RequestOutput.from_seq_group(group))
        return outputs

    def _finish_pooled(self, group: SequenceGroup, out: PoolingSequenceGroupOutput, now: float
                       ) -> PoolingRequestOutput:
        group.pooled_data = out.data
        group.metrics.first_token_time = group.metrics.finished_time = now
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_STOPPED
            self.scheduler.free_seq(seq)
        self.seq_groups.pop(group.request_id, None)
        return PoolingRequestOutput.from_seq_group(group)

    def _append_samples(self, group: SequenceGroup, samples: list[SequenceOutput]) -> None:
        by_parent: dict[int, list[SequenceOutput]] = {}
        for sample in samples:
            by_parent.setdefault(sample.parent_seq_id, []).append(sample)
        by_id = {seq.seq_id: seq for seq in group.seqs}
        for parent_id, parent_samples in by_parent.items():
            parent = by_id[parent_id]
            seqs = [parent]
            # n > 1: a fresh prompt's samples 1..n-1 fork the parent (sample 0), in order.
            for index in range(1, len(parent_samples)):
                child = parent.fork(next(self._seq_ids), sample_index=index)
                self.scheduler.fork_seq(parent, child)
                group.seqs.append(child)
                seqs.append(child)
            for seq, sample in zip(seqs, parent_samples, strict=True):
                seq.append_token(sample.output_token, sample.logprobs)
                self._check_stop(seq, group.sampling_params, group.grammar)
                if seq.is_finished():
                    seq.held_back = 0  # the whole text is final now
                    self.scheduler.free_seq(seq)

    def _append_accepted(self, group: SequenceGroup, samples: list[SequenceOutput]) -> None:
        """Tokens after a sequence's first of the step (an accepted draft's successor, or a
        later pass of multi-step decoding): each one means the step cached the K/V of the
        token before it. A sequence that stopped earlier in the step discards them."""
        by_id = {seq.seq_id: seq for seq in group.seqs}
        for sample in samples:
            seq = by_id[sample.parent_seq_id]
            if seq.is_finished():
                continue
            self.scheduler.advance_computed(seq, 1)
            seq.append_token(sample.output_token, sample.logprobs)
            self._check_stop(seq, group.sampling_params, group.grammar)
            if seq.is_finished():
                seq.held_back = 0
                self.scheduler.free_seq(seq)

    def _check_stop(self, seq: Sequence, params: SamplingParams,
                    grammar: Grammar | None = None) -> None:
        token = seq.output_token_ids[-1]
        verdict = None if grammar is None else self.structured_outputs.accept(seq, grammar)
        if verdict == "refused":
            seq.status = SequenceStatus.FINISHED_ABORTED
            return
        n_out = len(seq.output_token_ids)
        eos = not params.ignore_eos and token in params.eos_token_ids
        stop_token = n_out >= params.min_tokens and (eos or token in params.stop_token_ids)
        if stop_token and not params.include_stop_str_in_output:
            # The stopping token's text is not part of the output (as in vLLM): not decoded
            # in context, so its logprob entries get each id's own text.
            new_text = ""
            if params.logprobs is not None:
                self.detokenizer.decode_logprobs(seq.output_logprobs[-1])
        else:  # gives the logprob entries their text in context
            new_text = self.detokenizer.decode_new_token(seq, params)
        if stop_token:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if eos else token
            return
        if n_out >= params.min_tokens:
            stop = find_stop_string(seq, len(new_text), params)
            if stop is not None:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return
        if verdict == "end":  # the grammar is complete: nothing more may follow
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if (params.max_tokens is not None and n_out >= params.max_tokens) or \
                seq.get_len() >= self.model_config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            return
        seq.held_back = held_back_length(seq.output_text, params.stop)
