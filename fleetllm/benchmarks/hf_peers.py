"""The transformers peers the benchmarks compare against, run in the benchmark's process on
the same requests, weights, dtype and thread count:

- `hf`: `model.generate`, static batches, left-padded;
- `hf-cb`: transformers' continuous batching (`continuous_batching_context_manager`, its paged
  attention), one request per prompt with its own max_new_tokens;
- for `--task embed`, `HFEmbed`: `AutoModel` (no LM head) over static right-padded batches
  with their attention mask, the last hidden state pooled as the engine pools (LAST picked
  with the mask, MEAN over the mask, CLS), then normalized: what an embedding user writes.

The generating peers produce exactly each request's output length (EOS disabled), greedy.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

from fleetllm.benchmarks.workload import Request

# A mixture of experts' expert tensor: (layer, expert, name) (fleetllm/model/moe.py's names)
_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                            r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


def load_hf_model(model_dir: str, dummy_seed: int | None,
                  dtype: torch.dtype = torch.float32, base: bool = False) -> Any:
    """The checkpoint as a transformers model in `dtype` (the fleetllm engine's, so both
    round alike): AutoModelForCausalLM, or with base=True AutoModel (the decoder stack
    without the LM head, what an embedding model is loaded as); with dummy_seed, the dummy
    weights fleetllm generates for that seed (load_format="dummy"), so both compute the same
    function."""
    import transformers

    from fleetllm.config import ArchConfig, read_json
    from fleetllm.model.loader import dummy_tensor, hf_tensor_shapes

    auto = transformers.AutoModel if base else transformers.AutoModelForCausalLM
    if dummy_seed is None and not base:
        return auto.from_pretrained(model_dir, dtype=dtype).eval()
    if dummy_seed is None:
        # A generating checkpoint's lm_head.weight is left unused, which transformers reports
        # in a warning table; quiet, but weights the checkpoint lacks are refused (transformers
        # would initialize them randomly and the comparison would be meaningless).
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            model, info = auto.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
        finally:
            transformers.logging.set_verbosity(verbosity)
        if info["missing_keys"] or info["mismatched_keys"]:
            raise RuntimeError(f"{model_dir} lacks weights AutoModel needs: "
                               f"{sorted(info['missing_keys'])[:3]} "
                               f"{sorted(info['mismatched_keys'])[:3]}")
        return model.eval()
    raw = read_json(Path(model_dir) / "config.json")
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = auto.from_config(config, dtype=dtype)
    shapes = hf_tensor_shapes(ArchConfig.from_dict(raw))
    # Parameter name -> checkpoint name (the dummy draw is seeded by the checkpoint name):
    # AutoModel's parameters lack the "model." prefix, and it has no LM head.
    names = {n: n for n in shapes}
    if base:
        names = {n.removeprefix("model."): n for n in shapes if n != "lm_head.weight"}
    # A mixture of experts: transformers stacks the experts (mlp.experts.gate_up_proj
    # [E, 2I, H], down_proj [E, H, I]) and calls Mixtral's block_sparse_moe mlp.
    experts = {}  # checkpoint name -> (stacked parameter, expert, first row or None: down)
    for param, ckpt in list(names.items()):
        match = _EXPERT_TENSOR.fullmatch(ckpt)
        if ".block_sparse_moe." in ckpt or match:
            del names[param]
        if match is None:
            names[param.replace(".block_sparse_moe.", ".mlp.")] = ckpt
            continue
        stacked = f"model.layers.{match[1]}.mlp.experts."
        rows = shapes[ckpt][0]
        experts[ckpt] = (stacked + "down_proj", int(match[2]), None) if match[3] in (
            "down_proj", "w2") else (stacked + "gate_up_proj", int(match[2]),
                                     0 if match[3] in ("gate_proj", "w1") else rows)
    # One tensor at a time (load_state_dict of them all would hold a float32 copy of the
    # whole model); copy_ rounds to the model's dtype as fleetllm's loader does.
    params = dict(model.named_parameters())
    missing = set(params) - set(names) - {"lm_head.weight"} - {p for p, _, _ in
                                                                 experts.values()}
    unexpected = set(names) - set(params)
    if unexpected or missing:
        raise RuntimeError(f"dummy weights do not fit the model: {sorted(missing)[:3]} "
                           f"{sorted(unexpected)[:3]}")
    with torch.no_grad():
        for name, ckpt_name in names.items():
            params[name].copy_(dummy_tensor(ckpt_name, shapes[ckpt_name], dummy_seed))
        for ckpt_name, (name, expert, first) in experts.items():
            tensor = dummy_tensor(ckpt_name, shapes[ckpt_name], dummy_seed)
            target = params[name][expert]
            if first is not None:
                target = target[first:first + tensor.shape[0]]
            target.copy_(tensor)
    if config.tie_word_embeddings and not base:
        model.tie_weights()
    return model.eval()


class HFGenerate:
    """model.generate over static batches of the requests in their order (as a caller feeding
    it requests as they come would), or with sort=True in order of output then prompt length
    (the grouping that wastes least on padding and finished rows: its most favourable). Each
    batch generates its longest output length; only each request's own length counts."""

    def __init__(self, model: Any, batch_size: int, sort: bool = False):
        self.model, self.batch_size, self.sort = model, batch_size, sort
        self.name = "HF generate (sorted)" if sort else "HF generate"

    def run(self, requests: list[Request]) -> list[list[int]]:
        order = list(range(len(requests)))
        if self.sort:
            order.sort(key=lambda i: (requests[i].output_len, len(requests[i].prompt)))
        outputs: list[list[int]] = [[] for _ in requests]
        for start in range(0, len(order), self.batch_size):
            batch = [requests[i] for i in order[start:start + self.batch_size]]
            width = max(len(r.prompt) for r in batch)
            ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt)
                                 for r in batch])
            new = max(r.output_len for r in batch)
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, pad_token_id=0, eos_token_id=None)
            for i, r in zip(order[start:start + self.batch_size], batch, strict=True):
                row = list(order[start:start + self.batch_size]).index(i)
                outputs[i] = out[row, width:width + r.output_len].tolist()
        return outputs


class HFContinuousBatching:
    """transformers' continuous batching manager, kept between runs; each request has its
    own max_new_tokens."""

    name = "HF continuous batching"

    def __init__(self, model: Any):
        from transformers import GenerationConfig

        self.model = model
        self.config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1,
                                       pad_token_id=0)
        # Its CPU memory probe complains about a missing optional dependency (psutil).
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    def run(self, requests: list[Request]) -> list[list[int]]:
        results: dict[str, Any] = {}
        with self.model.continuous_batching_context_manager(
                generation_config=self.config, persistent_manager=True) as manager:
            for i, r in enumerate(requests):
                manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.output_len,
                                    eos_token_id=-1)
            deadline = time.monotonic() + 3600
            while len(results) < len(requests):
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                elif out is None and (not manager.is_running() or time.monotonic() > deadline):
                    raise RuntimeError("transformers' continuous batching stopped early")
        return [list(results[f"r{i}"].generated_tokens) for i in range(len(requests))]


class HFEmbed:
    """AutoModel over static batches, right-padded (positions then start at 0 for every row,
    as in an unpadded forward) with the attention mask; the last hidden state pooled with the
    mask as `pooling_type` says, in float32, then L2-normalized if `normalize`. In the
    requests' order, or with sort=True longest first (sentence-transformers' encode order: the
    least padding). Returns one float32 vector per request, in request order."""

    def __init__(self, model: Any, batch_size: int, pooling_type: str, normalize: bool,
                 sort: bool = False):
        self.model, self.batch_size, self.sort = model, batch_size, sort
        self.pooling_type, self.normalize = pooling_type, normalize
        self.name = "HF AutoModel (sorted)" if sort else "HF AutoModel"

    def run(self, requests: list[Request]) -> list[torch.Tensor]:
        order = list(range(len(requests)))
        if self.sort:
            order.sort(key=lambda i: -len(requests[i].prompt))
        outputs: list[torch.Tensor] = [torch.empty(0)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            lengths = torch.tensor([len(requests[i].prompt) for i in rows])
            width = int(lengths.max())
            ids = torch.tensor([requests[i].prompt + [0] * (width - len(requests[i].prompt))
                                for i in rows])
            mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
            with torch.inference_mode():
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                pooled = pool_padded(hidden.float(), mask, lengths, self.pooling_type)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for row, i in enumerate(rows):
                outputs[i] = pooled[row]
        return outputs


def pool_padded(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
                pooling_type: str) -> torch.Tensor:
    """[batch, width, hidden] right-padded states -> [batch, hidden]: LAST (each row's last
    real token), MEAN (over the real tokens) or CLS (the first)."""
    if pooling_type == "LAST":
        return hidden[torch.arange(hidden.shape[0]), lengths - 1]
    if pooling_type == "MEAN":
        return (hidden * mask[..., None]).sum(1) / lengths[:, None]
    if pooling_type == "CLS":
        return hidden[:, 0]
    raise ValueError(f"unknown pooling type {pooling_type!r} (LAST, MEAN, CLS)")
