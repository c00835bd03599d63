"""The transformers peers the benchmarks compare against, run in the benchmark's process on
the same requests, weights, dtype and thread count:

- `hf`: `model.generate`, static batches, left-padded;
- `hf-cb`: transformers' continuous batching (`continuous_batching_context_manager`, its paged
  attention), one request per prompt with its own max_new_tokens.

Both generate exactly each request's output length (EOS disabled), greedy.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from fleetllm.benchmarks.workload import Request


def load_hf_model(model_dir: str, dummy_seed: int | None,
                  dtype: torch.dtype = torch.float32) -> Any:
    """The checkpoint as a transformers model in `dtype` (the fleetllm engine's, so both
    round alike); with dummy_seed, the dummy weights fleetllm generates for that seed
    (load_format="dummy"), so both compute the same function."""
    import transformers

    from fleetllm.config import ArchConfig, read_json
    from fleetllm.model.loader import dummy_tensor, hf_tensor_shapes

    if dummy_seed is None:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    raw = read_json(Path(model_dir) / "config.json")
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    shapes = hf_tensor_shapes(ArchConfig.from_dict(raw))
    # One tensor at a time (load_state_dict of them all would hold a float32 copy of the
    # whole model); copy_ rounds to the model's dtype as fleetllm's loader does.
    params = dict(model.named_parameters())
    missing = set(params) - set(shapes) - {"lm_head.weight"}
    unexpected = set(shapes) - set(params)
    if unexpected or missing:
        raise RuntimeError(f"dummy weights do not fit the model: {sorted(missing)[:3]} "
                           f"{sorted(unexpected)[:3]}")
    with torch.no_grad():
        for name, shape in shapes.items():
            params[name].copy_(dummy_tensor(name, shape, dummy_seed))
    if config.tie_word_embeddings:
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
