"""EmbeddingModelRunner: the model runner of a pooling model (task "embed").

The same flat token batch and forward as ModelRunner, then, instead of logits and sampling,
each finished prompt's hidden states are pooled (model/pooler.py) into one vector on the
output rank. There is no KV cache: the scheduler runs every pooling prompt whole, in one
step (Scheduler._whole), so attention only needs the step's own keys and values, and the
runner forwards with kv_caches=None (the attention backend then attends within each span).
"""

from __future__ import annotations

import torch

from fleetllm.model import pooler
from fleetllm.sequence import (
    ExecuteModelRequest,
    PoolingSequenceGroupOutput,
    SamplerOutput,
    SequenceData,
    SequenceGroupMetadata,
)
from fleetllm.worker.model_runner import ModelRunner, _Batch


class EmbeddingModelRunner(ModelRunner):
    @torch.inference_mode()
    def execute_model(self, request: ExecuteModelRequest,
                      kv_caches: list[torch.Tensor] | None = None) -> SamplerOutput | None:
        groups = request.seq_group_metadata_list
        if not groups:
            return SamplerOutput([]) if self.is_output_rank else None
        batch = self._prepare(request)
        hidden = self._run_model(batch, None)
        if hidden is None or not self.is_output_rank:
            return None
        cfg = self.config.model_config.pooler_config
        outputs = []
        for g_index, start, length in batch.pool_spans:
            params = groups[g_index].pooling_params
            normalize = cfg.normalize if params.normalize is None else params.normalize
            vector = pooler.pool(hidden[start: start + length], cfg.pooling_type)
            outputs.append(PoolingSequenceGroupOutput(
                groups[g_index].request_id,
                pooler.finish(vector, params.dimensions, normalize).cpu()))
        return SamplerOutput(outputs)

    @staticmethod
    def _add_rows(batch: _Batch, g_index: int, group: SequenceGroupMetadata, seq_id: int,
                  data: SequenceData, q_start: int, start: int, end: int) -> None:
        """Where the group's prompt sits in the flat batch (no logits rows, no draws)."""
        if group.pooling_params is None or start != 0 or end != len(data.prompt_token_ids):
            raise RuntimeError(f"request {group.request_id}: a pooling model runs whole "
                               f"prompts with PoolingParams; got tokens [{start}, {end}) of "
                               f"{len(data.prompt_token_ids)}")
        batch.pool_spans.append((g_index, q_start, end - start))
