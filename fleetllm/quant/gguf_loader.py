"""Fill a model from a GGUF file: the model's weight loaders keep each projection's (and the
embedding's) blocks for this rank (layers.stash: whole rows, whole blocks of columns), then
`finish` packs each module's parts into one copy (packed.py) and gives the module its Gguf
kernel; the dense parameter, never written, is dropped. A module whose parts are all F32/F16/
BF16 gets its dense weight instead, and the usual kernels. An MoE layer's experts are packed
by their own module (model/moe_experts.FusedExperts.finish_quantized). Nothing dequantized is
kept: the embedding's rows are dequantized as they are looked up.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fleetllm.distributed.parallel_state import get_pp_group, get_tp_group
from fleetllm.errors import ModelLoadError
from fleetllm.model import linear_kernels as lk
from fleetllm.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from fleetllm.model.moe_experts import FusedExperts
from fleetllm.progress import ProgressBar
from fleetllm.quant.gguf_checkpoint import GgufFile, open_gguf, tensors
from fleetllm.quant.packed import QuantTensor, pack


def load_gguf(model: nn.Module, path: str) -> None:
    ckpt = open_gguf(path)
    expected = {name for name, _ in model.named_parameters()}
    first_rank = get_tp_group().is_first and get_pp_group().is_first
    loaded = model.load_weights(ProgressBar(tensors(ckpt), desc="Loading GGUF tensors",
                                            unit="tensor", total=_count(ckpt),
                                            disable=not first_rank), path)
    if model.cfg.tie_word_embeddings and getattr(model, "lm_head", None) is not None:
        loaded.add("lm_head.weight")
    finish(model)
    # The packed copies hold the blocks now: drop the reader, whose mapping of the file would
    # keep its pages resident beside them (a 1B Q4_K_M model: 0.8 GB twice).
    open_gguf.cache_clear()
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"{path}: lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _count(ckpt: GgufFile) -> int:
    """The tensors the loader is given: an MoE layer's 3-D expert tensor is one an expert."""
    return sum(int(t.shape[-1]) if len(t.shape) == 3 else 1 for t in ckpt.reader.tensors)


def finish(model: nn.Module) -> None:
    """Pack each module's kept blocks (see the module docstring). An embedding's rows are
    looked up in the model's dtype: its norm_dtype (its norms', never quantized; every
    parameter is made in that dtype, so it is the first floating one's, as before)."""
    dtype = model.norm_dtype
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedExperts):  # an MoE layer's experts: their own packing
            try:
                module.finish_quantized()
            except ValueError as e:
                raise ModelLoadError(f"{name}: {e}") from e
            continue
        parts = module.__dict__.pop("quant_parts", None)
        if not parts:
            continue
        count = len(module.parts) if isinstance(module, ColumnParallelLinear) else 1
        if sorted(parts) != list(range(count)):
            raise ModelLoadError(f"{name} has parts {sorted(parts)} of {count}")
        ordered = [parts[i] for i in range(count)]
        if isinstance(module, VocabParallelEmbedding) and module.valid < module.shard:
            pad = ordered[0]  # the last shard's padding rows: zero blocks are zero weights
            ordered.append(QuantTensor(np.zeros((module.shard - module.valid,
                                                 pad.raw.shape[1]), np.uint8), pad.qtype,
                                       (module.shard - module.valid, pad.shape[1]),
                                       pad.perm))
        if not any(p.quantized for p in ordered):
            _load_dense(module, ordered)
            continue
        try:
            packed = pack(ordered)
        except ValueError as e:  # act-order q/k/v (gate/up) whose g_idx differ
            raise ModelLoadError(f"{name}: {e}") from e
        install(model, module, packed, dtype)


def install(model: nn.Module, module: nn.Module, packed: torch.Tensor,
            dtype: torch.dtype) -> None:
    """Give module its packed copy (packed.py) in place of its dense weight, which is dropped
    (never written: no memory was touched): a projection's or the LM head's Gguf kernel, an
    embedding's rows (`packed`, looked up in `dtype`; a tied LM head's kernel shares them).
    Also how sharded_state loads a saved GGUF model's copies."""
    if isinstance(module, ParallelLMHead):
        module.kernel = lk.Gguf(packed, module.shard)
    elif isinstance(module, VocabParallelEmbedding):
        module.packed, module.packed_dtype = packed, dtype
        head = getattr(model, "lm_head", None)
        if head is not None and head.weight is module.weight:  # tied: the same blocks
            head.kernel = lk.Gguf(packed, head.shard)
            head.weight = None
    else:
        module.kernel = lk.Gguf(packed, module.weight.shape[0])
    module.weight = None


def _load_dense(module: nn.Module, parts: list[QuantTensor]) -> None:
    rows = torch.cat([p.dequantize() for p in parts]).to(module.weight.dtype)
    module.weight.data.copy_(rows)
