"""Which fast path may take a step's requests: one decision for the engine and the workers.

Multi-step calls (LLMEngine._num_steps -> MultiStepWorker) and speculative drafts
(SpecDecodeWorker) choose tokens with no engine work between them; the plain greedy passes
(worker/greedy_passes.py) also skip the sampler. A request's part is SamplingParams.fast_paths
(every field classified in sampling_params.FAST_PATH_FIELDS, computed once per request); the
predicates here add the step's state: prompt or decode, sampled, adapter, tokens so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetllm.sequence import SequenceGroupMetadata


def multi_step(groups: list[SequenceGroupMetadata]) -> bool:
    """These groups may run as one multi-step call: decodes only, each running ahead (the
    engine also requires nothing waiting or swapped)."""
    return not any(g.is_prompt or not g.sampling_params.fast_paths.runs_ahead for g in groups)


def may_draft(group: SequenceGroupMetadata) -> bool:
    """A group's sequences may get drafts this step: a sampled decode that runs ahead."""
    return not group.is_prompt and group.do_sample and group.sampling_params.fast_paths.runs_ahead


def plain_argmax(groups: list[SequenceGroupMetadata]) -> bool:
    """Every row of these decode groups takes its plain argmax in every pass from here on
    (the greedy passes): no adapter, and min_tokens no longer holding back a stop token."""
    for group in groups:
        params = group.sampling_params
        start = None if params is None else params.fast_paths.argmax_from
        if (start is None or group.is_prompt or not group.do_sample
                or group.lora_request is not None
                or (start and any(len(d.output_token_ids) < start
                                  for d in group.seq_data.values()))):
            return False
    return True
