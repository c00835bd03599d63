"""The vLLM end of the benchmarks' vLLM peer; vllm_peer.py starts and drives it.

Run by path with the vLLM venv's interpreter, so it imports only the standard library and vllm.
One JSON object per line each way on stdin/stdout (vLLM's logs go to stderr):

    -> {"op": "load", "model": DIR, "dtype": "bfloat16", "enforce_eager": false, ...}
    -> {"op": "run", "requests": [[[prompt token ids], max_tokens], ...], "stream": false}
    -> {"op": "exit"}
    <- {"ok": true, ...} or {"ok": false, "error": "...", "traceback": "..."}

A run is greedy, each request exactly max_tokens long, the prefix cache emptied first;
"seconds" times the generation alone, and "stream": true also reports each token's arrival.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from typing import Any


def _load(msg: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(model=msg["model"], dtype=msg["dtype"], enforce_eager=msg["enforce_eager"],
               max_model_len=msg["max_model_len"], seed=msg.get("seed", 0),
               skip_tokenizer_init=True)


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


def _run(llm: Any, msg: dict[str, Any], round_id: int) -> dict[str, Any]:
    requests = msg["requests"]
    llm.reset_prefix_cache()
    if not msg.get("stream"):
        prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
        params = [_params(n) for _, n in requests]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {"ok": True, "seconds": seconds, "token_times": None,
                "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    engine = llm.llm_engine
    ids = [f"r{round_id}-{i}" for i in range(len(requests))]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    times: dict[str, list[float]] = {i: [] for i in ids}
    start = time.perf_counter()
    for rid, (prompt, n) in zip(ids, requests, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, _params(n))
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            tokens = list(out.outputs[0].token_ids)  # cumulative
            times[out.request_id] += [now] * (len(tokens) - len(times[out.request_id]))
            outputs[out.request_id] = tokens
    seconds = time.perf_counter() - start
    return {"ok": True, "seconds": seconds, "outputs": [outputs[i] for i in ids],
            "token_times": [times[i] for i in ids]}


def _one_line(e: Exception) -> str:
    """The error on one line (the CLI prints an error's first): vLLM's config errors are
    pydantic's, whose first line is only "1 validation error for VllmConfig" and whose reason
    ("Value error, Unsupported quantization config: ...") follows, with a tail of context."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()
             and not line.strip().startswith("For further information")]
    return ": ".join(re.sub(r" \[type=.*$", "", line) for line in lines)


def main() -> int:
    # The protocol gets a private copy of stdout; fd 1 then points at stderr, so whatever
    # vLLM (or its engine-core child, which inherits fd 1) prints cannot corrupt it.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = None
    for round_id, line in enumerate(sys.stdin):
        msg = json.loads(line)
        try:
            if msg["op"] == "exit":
                break
            if msg["op"] == "load":
                import vllm

                start = time.perf_counter()
                llm = _load(msg)
                reply = {"ok": True, "vllm": vllm.__version__,
                         "seconds": time.perf_counter() - start}
            elif msg["op"] == "run":
                if llm is None:
                    raise RuntimeError("run before load")
                reply = _run(llm, msg, round_id)
            else:
                raise ValueError(f"unknown op {msg['op']!r}")
        except Exception as e:  # reported to the driver, which raises it there
            reply = {"ok": False, "error": f"{type(e).__name__}: {_one_line(e)}",
                     "traceback": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
