"""Offline embedding throughput: `fleetllm bench throughput --task embed`, the throughput
benchmark with a pooling model.

    fleetllm bench throughput --preset llama-125m --task embed --compare hf --hf-sort
    fleetllm bench throughput --model DIR --task embed [--num-prompts N] [--input-len L:H]

The throughput benchmark's flags and timing, on --num-prompts random inputs pooled through
`LLM(path, task="embed").embed(...)`, against transformers `AutoModel` on the same weights,
pooled and normalized as the engine's pooler_config says (--hf-sort: length-sorted batches).
Printed: sequences/s and tokens/s (real tokens, not padding), fleetllm's ratios, and how its
vectors agree with the peer's (cosine, largest relative difference). Generation-only options
(--output-len, --shared-prefix, --compare hf-cb or vllm) are a ConfigurationError.
"""

from __future__ import annotations

import argparse
import json

import torch

from fleetllm.benchmarks import workload
from fleetllm.benchmarks.engines import FleetEngine, compare_peers, engine_dtype, measure
from fleetllm.errors import ConfigurationError

_DEFAULTS = dict(num_prompts=256, input_len=(16, 256), hf_batch_size=32)
_GENERATE_PEERS = {"hf-cb", "vllm"}


def is_pooling(model: str, kwargs: dict) -> bool:
    """Whether the engine flags make `model` a pooling model (task "embed"), as the engine
    will resolve them; reads only config.json (and modules.json)."""
    from fleetllm.config import ModelConfig

    keys = ("task", "runner", "override_pooler_config", "pooler_config")
    return ModelConfig(model, **{k: kwargs[k] for k in keys if k in kwargs}).is_pooling


class FleetEmbed(FleetEngine):
    """fleetllm through LLM.embed; one float32 vector per input, in input order."""

    def run(self, requests: list[workload.Request]) -> list[torch.Tensor]:
        outs = self.llm.embed([{"prompt_token_ids": r.prompt} for r in requests],
                              use_tqdm=False)
        for i, o in enumerate(outs):
            if o.error:  # e.g. longer than max_model_len: the figures would be wrong
                raise ConfigurationError(f"{self.name} refused input {i} "
                                         f"({len(requests[i].prompt)} tokens): {o.error}")
        return [torch.tensor(o.outputs.embedding) for o in outs]


def _check_args(args: argparse.Namespace) -> set[str]:
    """The peers; refuses what only means something for generation."""
    given = {p.strip() for p in (args.compare or "").split(",")}
    wrong = sorted(given & _GENERATE_PEERS)
    if wrong:
        raise ConfigurationError(f"--compare {','.join(wrong)}: generation peers; with --task "
                                 "embed the peer is hf (transformers AutoModel + pooling) or "
                                 "none")
    for flag, value in (("--output-len", args.output_len), ("--shared-prefix",
                                                           args.shared_prefix)):
        if value:
            raise ConfigurationError(f"{flag} applies to generation, not to --task embed "
                                     "(each input is pooled once)")
    return compare_peers(args.compare, {"hf"}, {"hf"})


def run(args: argparse.Namespace, model: str, kwargs: dict, dummy_seed: int | None) -> dict:
    peers = _check_args(args)
    for name, value in {**_DEFAULTS, "repeat": 2 if args.preset else 3}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.output_len = (0, 0)  # nothing is generated (the dataset's output lengths are unused)
    if args.hf_batch_size == 0:
        peers.discard("hf")
    engines: list = [FleetEmbed("fleetllm", model, kwargs)]
    try:
        if args.compare_backend:
            engines.append(FleetEmbed(f"fleetllm ({args.compare_backend})", model,
                                       {**kwargs, "distributed_executor_backend":
                                        args.compare_backend}))
        llm = engines[0].llm
        pooler = llm.llm_engine.model_config.pooler_config
        dtype = engine_dtype(llm)
        if "hf" in peers:
            from fleetllm.benchmarks.hf_peers import HFEmbed, load_hf_model

            hf = load_hf_model(model, dummy_seed, dtype, base=True)
            engines.append(HFEmbed(hf, args.hf_batch_size, pooler.pooling_type,
                                   pooler.normalize))
            if args.hf_sort:
                engines.append(HFEmbed(hf, args.hf_batch_size, pooler.pooling_type,
                                       pooler.normalize, sort=True))
        arch = llm.llm_engine.model_config.arch
        tokenizer = llm.get_tokenizer()
        vocab = min(arch.vocab_size, len(tokenizer) if tokenizer else arch.vocab_size)
        requests = workload.make_requests(args, vocab, tokenizer)
        results = measure(engines, requests, args.repeat)
    finally:
        for e in engines:
            if isinstance(e, FleetEngine):
                e.llm.shutdown()
    figures = _report(args, model, engines, requests, results, pooler, dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


def _report(args, model: str, engines, requests, results: dict, pooler, dtype) -> dict:
    n_tokens = sum(len(r.prompt) for r in requests)
    lengths = [len(r.prompt) for r in requests]
    dtype_name = str(dtype).removeprefix("torch.")
    figures: dict = {"model": args.preset or model, "task": "embed", "dtype": dtype_name,
                     "pooling_type": pooler.pooling_type, "normalize": pooler.normalize,
                     "inputs": len(requests), "input_tokens": n_tokens,
                     "torch_threads": torch.get_num_threads(), "repeat": args.repeat,
                     "hf_batch_size": args.hf_batch_size, "engines": {}, "ratios": {}}
    print(f"model: {args.preset or model} ({dtype_name}), task embed: "
          f"{pooler.pooling_type} pooling{', normalized' if pooler.normalize else ''}")
    print(f"inputs: {len(requests)}, {n_tokens} tokens ({min(lengths)}-{max(lengths)} each); "
          f"torch threads: {torch.get_num_threads()}; best of {args.repeat} rounds, engines "
          "taking turns")
    if any(e.name.startswith("HF") for e in engines):
        print(f"HF AutoModel: batches of {args.hf_batch_size}, right-padded with the attention "
              "mask, in input order" + (" and (sorted) longest first" if args.hf_sort else ""))
    for e in engines:
        seconds = results[e.name][0]
        f = figures["engines"][e.name] = {
            "seconds": seconds, "sequences_per_s": len(requests) / seconds,
            "tokens_per_s": n_tokens / seconds}
        print(f"{e.name + ':':32s} {f['sequences_per_s']:8.2f} sequences/s  "
              f"{f['tokens_per_s']:9.1f} tokens/s  ({seconds:.2f} s)")
    ours, our_vectors, _ = results["fleetllm"]
    for e in engines[1:]:
        seconds, vectors, _ = results[e.name]
        pairs = [(a.double(), b.double()) for a, b in zip(our_vectors, vectors, strict=True)]
        cos = torch.stack([torch.nn.functional.cosine_similarity(a, b, dim=0)
                           for a, b in pairs])
        # The cosine ignores length: without normalizing, the lengths must agree too.
        rel = max(float((a - b).norm() / a.norm()) for a, b in pairs)
        figures["ratios"][e.name] = {"speedup": seconds / ours, "cosine_min": float(cos.min()),
                                     "cosine_mean": float(cos.mean()),
                                     "max_relative_difference": rel}
        print(f"ratio fleetllm / {e.name}: {seconds / ours:.2f}x  (vectors over {len(cos)} "
              f"inputs: cosine min {float(cos.min()):.6f}, mean {float(cos.mean()):.6f}; "
              f"largest relative difference {rel:.1e})")
    return figures
