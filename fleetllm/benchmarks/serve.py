"""Online serving benchmark, like vLLM's: N streaming requests against an OpenAI-compatible
server at a Poisson request rate, then throughput and TTFT / ITL / E2E latency.

    fleetllm bench serve --base-url http://127.0.0.1:8000 [--num-prompts 200] [--input-len 128
        --output-len 64 | --dataset prompts.jsonl] [--request-rate 8 | inf] [--endpoint ...]
    fleetllm bench serve [--offline-replay] [--repeat N] [serve flags: --model DIR, ...]

Without --base-url it starts and stops `fleetllm serve` itself (unknown flags go to it). Prompts
are exactly --input-len tokens (the server's /tokenize), outputs exactly their length; a request
counts only if its stream carried text. --structured-fraction: that share are grammar requests
(TPOT per class); --offline-replay: the same arrivals through an in-process LLMEngine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from fleetllm.benchmarks import serve_replay
from fleetllm.benchmarks.serve_figures import (
    RequestResult,
    print_ratios,
    print_result,
    ratios,
    summarize,
)

_WORDS = ("the of and to in is was for on that with as by at from his her which an be this "
          "are were had have not but all they one can there their been has more if will "
          "would about who out so what up time into year some could them other than then "
          "only its over also after first two may new any these most world engine token "
          "model server request stream batch cache block layer python function return value "
          "import class def print range list dict error tensor worker process").split()
CHAT_ENDPOINT = "/v1/chat/completions"
# Open-ended (a list of any length), so that a grammar request runs about as long as a plain
# one, with objects, strings and numbers for the grammar to follow.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"},
                   "items": {"type": "array", "items": {
                       "type": "object",
                       "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
                       "required": ["name", "count"]}}},
    "required": ["title", "items"]}


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's own flags; main() hands the ones it does not know to the server."""
    parser = argparse.ArgumentParser(prog="fleetllm bench serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start one with the other flags)")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help=f"/v1/completions (default) or {CHAT_ENDPOINT}")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dataset", default=None, help="JSONL file of prompts")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (default 0: greedy)")
    parser.add_argument("--structured-fraction", type=float, default=0.0, metavar="F",
                        help="share of the requests constrained to a fixed JSON schema "
                             "(0 to 1; default 0); TPOT is reported per class")
    parser.add_argument("--compare", choices=["vllm"], default=None,
                        help="also start `vllm serve` (the peer venv, `make peers`) on the same "
                             "checkpoint and run the same requests against it, then print "
                             "the ratios (needs the server flags, not --base-url)")
    parser.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for "
                        "the vLLM server (default 0-1: this machine's two cores)")
    parser.add_argument("--vllm-kv-gb", type=int, default=4,
                        help="VLLM_CPU_KVCACHE_SPACE for the vLLM server (GiB)")
    parser.add_argument("--offline-replay", action="store_true",
                        help="after the server run, replay the same requests at the same "
                        "moments through an in-process LLMEngine with the same engine flags "
                        "and print the serving overhead (needs a server this command starts)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run it all N times, taking turns (server, replay, peer; each "
                        "server started afresh) and print the medians of the serving "
                        "overhead and of the ratios: the machine's speed drifts between runs")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    parser.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int | dict:
    """The figures (also written by --json); --offline-replay (serve_replay.py) adds the same
    arrivals through an in-process LLMEngine, to show the serving overhead."""
    parser = build_parser()
    args, server_args = parser.parse_known_args(argv)
    if not 0 <= args.structured_fraction <= 1:
        parser.error("--structured-fraction: must be in [0, 1]")
    try:
        import httpx  # noqa: F401 - fail before starting anything
    except ImportError:
        print("error: fleetllm bench serve needs httpx (pip install httpx)")
        return 1
    if args.compare and args.base_url:
        parser.error("--compare starts both servers: give the server flags, not --base-url")
    if args.offline_replay and (args.base_url or _is_chat(args.endpoint)
                                or args.structured_fraction):
        parser.error("--offline-replay replays plain /v1/completions requests on the engine "
                     "of a server this command starts: drop --base-url, the chat endpoint and "
                     "--structured-fraction")
    if args.repeat < 1:
        parser.error("--repeat: must be at least 1")
    url = args.base_url  # None: each round starts a server of its own
    if url is not None and server_args:
        parser.error(f"unrecognized arguments: {' '.join(server_args)}")
    rounds: list[dict[str, Any]] = []
    prompts = None
    for k in range(args.repeat):
        if args.repeat > 1 and not args.quiet:
            print(f"{f' round {k + 1} of {args.repeat} ':#^60}")
        args.base_url = url
        result, prompts = _round(args, server_args, prompts)
        rounds.append(result)
    result = rounds[0] if len(rounds) == 1 else serve_replay.medians(rounds, args.quiet)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _round(args: argparse.Namespace, server_args: list[str], prompts: list | None
           ) -> tuple[dict[str, Any], list]:
    """One run of the requests against fleetllm's server (one this command starts and stops
    unless --base-url), then the replay and the peer where asked; (figures, prompts)."""
    server = None
    if args.base_url is None:
        from fleetllm.entrypoints.openai.local_server import LocalServer

        server = LocalServer(server_args)
        args.base_url = server.url
    try:
        result = asyncio.run(_run(args, prompts))
        prompts, arrivals = result.pop("prompts"), result.pop("arrivals")
    finally:
        if server is not None:
            server.stop()
    if not args.quiet:
        print_result(result)
    if args.offline_replay:
        result = serve_replay.with_replay(result, server_args, prompts, arrivals, args)
    if args.compare:
        from fleetllm.benchmarks.serve_peer import start_vllm_server

        fleet = result
        with start_vllm_server(server_args, args.vllm_bind, args.vllm_kv_gb) as peer:
            args.base_url = peer.url
            result = asyncio.run(_run(args, prompts))
            del result["prompts"], result["arrivals"]
        if not args.quiet:
            print_result(result, "vllm serve")
            print_ratios(ratios(fleet, result))
        result = {"fleetllm": fleet, "vllm": result, "ratios": ratios(fleet, result)}
    return result, prompts


async def _run(args: argparse.Namespace, prompts: list | None = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts or 1)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 limits=limits, timeout=timeout) as client:
        prompts = prompts or await _prompts(client, args)
        if _is_chat(args.endpoint):
            prompts = [(await _as_text(client, p), n) for p, n in prompts]
        rng = random.Random(args.data_seed)
        structured = set(rng.sample(range(len(prompts)),
                                    round(args.structured_fraction * len(prompts))))
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

        async def limited(prompt: Any, output_len: int, grammar: bool) -> RequestResult:
            async with gate:
                return await _one(client, args.endpoint, prompt, output_len, args.temperature,
                                  grammar)

        tasks, arrivals = [], []
        start = time.perf_counter()
        for i, (prompt, output_len) in enumerate(prompts):
            arrivals.append(time.perf_counter() - start)
            tasks.append(asyncio.create_task(limited(prompt, output_len, i in structured)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {**summarize(results, duration, args), "prompts": prompts, "arrivals": arrivals}


async def _prompts(client: Any, args: argparse.Namespace) -> list[tuple[Any, int]]:
    if args.dataset:
        out = []
        with open(args.dataset) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    prompt = row.get("prompt_token_ids") or row["prompt"]
                    out.append((prompt, int(row.get("output_len", args.output_len))))
        return out[:args.num_prompts] if args.num_prompts else out
    rng = random.Random(args.data_seed)
    need = args.input_len + args.num_prompts
    ids: list[int] = []
    words = need
    while len(ids) < need:  # a word is about one token: tokenize more until there are enough
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        ids = r.json()["tokens"]
        words *= 2
    return [(ids[i:i + args.input_len], args.output_len) for i in range(args.num_prompts)]


def _is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


async def _as_text(client: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    r = await client.post("/detokenize", json={"tokens": prompt})
    r.raise_for_status()
    return r.json()["prompt"]


def _body(endpoint: str, prompt: Any, output_len: int, temperature: float,
          structured: bool = False) -> dict[str, Any]:
    common: dict[str, Any] = {"ignore_eos": True, "stream": True, "temperature": temperature,
                              "stream_options": {"include_usage": True}}
    if structured:
        common["structured_outputs"] = {"json": STRUCTURED_SCHEMA}
    if _is_chat(endpoint):
        return {"messages": [{"role": "user", "content": prompt}],
                "max_completion_tokens": output_len, **common}
    return {"prompt": prompt, "max_tokens": output_len, **common}


def _chunk_text(chunk: dict[str, Any]) -> str:
    """A completions chunk's text, or a chat chunk's delta content."""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for c in chunk.get("choices") or [])


async def _one(client: Any, endpoint: str, prompt: Any, output_len: int,
               temperature: float = 0.0, structured: bool = False) -> RequestResult:
    body = _body(endpoint, prompt, output_len, temperature, structured)
    result = RequestResult(structured=structured)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        if result.ttft == 0.0:  # 200 and [DONE], but nothing generated is not a success
            result.error = "the stream carried no text"
            return result
        result.ok = True
    except Exception as e:  # one failed request is a figure, not the end of the benchmark
        result.error = f"{type(e).__name__}: {e}"
    return result


if __name__ == "__main__":
    main()
