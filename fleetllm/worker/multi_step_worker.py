"""MultiStepWorker: multi-step decoding (vLLM's num_scheduler_steps) around a worker.

With num_scheduler_steps=k the engine sends a decode-only batch as one request with
num_steps=k; this worker runs the k passes, broadcasting the output rank's tokens to every rank
after each (each rank feeds them to its own copy of the sequences). A sequence stops taking
passes at max_tokens or max_model_len; one that hits EOS or a stop string decodes on and the
engine discards the rest. Later passes use the scheduler's lookahead slots. Returns one
SamplerOutput per pass on the output rank, as a speculative step does. Plain-argmax batches
on one rank run greedy_passes.py instead; requests with num_steps 1 go to the wrapped worker.
What fails: an abort (Executor.interrupt_step bumps StepInterrupts) stops every rank after the
same pass; a failure in any pass fails the whole call and the engine recomputes the step.
"""

from __future__ import annotations

import dataclasses

import torch

from fleetllm import fast_paths
from fleetllm.config import EngineConfig
from fleetllm.distributed.parallel_state import broadcast_from_output_rank
from fleetllm.sequence import (
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    SamplerOutput,
    SequenceData,
    SequenceGroupMetadata,
    SequenceOutput,
)
from fleetllm.worker import greedy_passes
from fleetllm.worker.worker import Worker
from fleetllm.worker.worker_base import DelegatingWorker, StepInterrupts, WorkerBase


class MultiStepWorker(DelegatingWorker):
    def __init__(self, worker: WorkerBase, config: EngineConfig,
                 interrupts: StepInterrupts | None = None) -> None:
        super().__init__(worker)
        self.max_model_len = config.model_config.max_model_len
        self.block_size = config.cache_config.block_size
        self.interrupts = interrupts or StepInterrupts()
        self.single_rank = config.parallel_config.world_size == 1

    def execute_model(self, execute_model_req: ExecuteModelRequest
                      ) -> list[SamplerOutput] | None:
        req = execute_model_req
        if req.num_steps <= 1:
            return self.worker.execute_model(req)
        groups = [_own_copy(g) for g in req.seq_group_metadata_list]
        passes = [self._passes(g, req.num_steps) for g in groups]
        results: list[SamplerOutput] = []
        interrupts_before = self.interrupts.count
        step = 0
        while step < max(passes):
            active = [i for i, n in enumerate(passes) if n > step]
            # The passes all of them still take, by greedy_passes where it applies (the first
            # pass too, unless it moves blocks).
            if self._lean(active, groups) and (step > 0 or not (
                    req.blocks_to_swap_in or req.blocks_to_swap_out or req.blocks_to_copy)):
                most = min(passes[i] for i in active) - step
                done = self._greedy_passes(groups, active, most, interrupts_before, results,
                                           req.finished_requests_ids if step == 0 else [])
                step += done
                if done < most:  # interrupted, or every row drew a stop token: all done
                    break
                continue
            first = step == 0  # block moves and finished ids go with the first pass only
            sub = dataclasses.replace(
                req, seq_group_metadata_list=[groups[i] for i in active], num_steps=1,
                blocks_to_swap_in=req.blocks_to_swap_in if first else {},
                blocks_to_swap_out=req.blocks_to_swap_out if first else {},
                blocks_to_copy=req.blocks_to_copy if first else {},
                finished_requests_ids=req.finished_requests_ids if first else [])
            out = self.worker.execute_model(sub)
            seqs = [(groups[i], sid) for i in active for sid in groups[i].seq_data]
            # The sampled tokens, then 1 if the call ends here (an interrupt): every rank
            # learns both from the output rank.
            tokens = torch.zeros(len(seqs) + 1, dtype=torch.long, device=self._device())
            if out is not None:  # the output rank: its samples, in the same order
                drawn = {(s.parent_seq_id): s.output_token for g in out[0].outputs
                         for s in g.samples}
                stop = int(self.interrupts.count != interrupts_before)
                tokens = torch.tensor([drawn[sid] for _, sid in seqs] + [stop],
                                      device=tokens.device)
                results.append(_widen(out[0], active, groups))
            *tokens, stop = broadcast_from_output_rank(tokens).tolist()
            if stop:
                break
            for (group, sid), token in zip(seqs, tokens, strict=True):
                data = group.seq_data[sid]
                data.output_token_ids.append(token)
                data.num_computed_tokens += 1
            step += 1
        return results or None

    def _lean(self, active: list[int], groups: list[SequenceGroupMetadata]) -> bool:
        """The next passes can run as greedy_passes does: one rank, the stock Worker's
        execute_model (a worker that overrides it, by class or instance, sees every pass),
        plain greedy rows."""
        return (self.single_rank
                and getattr(self.worker.execute_model, "__func__", None) is Worker.execute_model
                and self.worker.cache_engine is not None
                and fast_paths.plain_argmax([groups[i] for i in active]))

    def _greedy_passes(self, groups: list[SequenceGroupMetadata], active: list[int],
                       most: int, interrupts_before: int, results: list[SamplerOutput],
                       finished_ids: list[str]) -> int:
        """Run up to `most` passes over the active groups by greedy_passes, append their
        outputs to results and their tokens to the groups' copies; returns the passes done."""
        seqs = [(i, sid) for i in active for sid in groups[i].seq_data]
        tokens = greedy_passes.run(self.worker.model_runner, self.worker.cache_engine.gpu_cache,
                                   [groups[i] for i in active], most, self.interrupts,
                                   interrupts_before, finished_ids)
        for row_tokens in tokens:
            outputs = [CompletionSequenceGroupOutput(g.request_id, []) for g in groups]
            for (i, sid), token in zip(seqs, row_tokens, strict=True):
                outputs[i].samples.append(SequenceOutput(sid, token, {}))
                data = groups[i].seq_data[sid]
                data.output_token_ids.append(token)
                data.num_computed_tokens += 1
            results.append(SamplerOutput(outputs))
        return len(tokens)

    def _device(self) -> torch.device:
        return getattr(self.worker, "device", torch.device("cpu"))

    def _passes(self, group: SequenceGroupMetadata, most: int) -> int:
        """Passes the group takes: it stops at max_tokens, at max_model_len, and where its
        block tables end (the scheduler may have had no room for lookahead slots)."""
        data = next(iter(group.seq_data.values()))  # a group's sequences advance together
        slots = min(len(t) for t in group.block_tables.values()) * self.block_size
        left = min(self.max_model_len, slots) - data.get_len() + 1
        if group.sampling_params.max_tokens is not None:
            left = min(left, group.sampling_params.max_tokens - len(data.output_token_ids))
        return max(1, min(most, left))


def _own_copy(group: SequenceGroupMetadata) -> SequenceGroupMetadata:
    """The group with its own output lists to append to (the prompt is shared, unchanged)."""
    seq_data = {sid: SequenceData(d.prompt_token_ids, list(d.output_token_ids),
                                  d.num_computed_tokens, d.sample_index)
                for sid, d in group.seq_data.items()}
    return dataclasses.replace(group, seq_data=seq_data)


def _widen(out: SamplerOutput, active: list[int], groups: list[SequenceGroupMetadata]
           ) -> SamplerOutput:
    """One pass's output over every group of the request (those that stopped: no samples)."""
    outputs = [CompletionSequenceGroupOutput(g.request_id, []) for g in groups]
    for i, group_out in zip(active, out.outputs, strict=True):
        outputs[i] = group_out
    return dataclasses.replace(out, outputs=outputs)
