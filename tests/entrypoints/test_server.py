"""`fleetllm serve` as a real process, driven by the official openai client and httpx
(issue: OpenAI-compatible server). One server for the whole module."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import resource
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving_helpers import (
    CHAT_TEMPLATE,
    KV,
    metric,
    metric_values,
    server_env,
    serving,
)

from fleetllm import LLM, SamplingParams
from fleetllm.entrypoints.openai.local_server import LocalServer

MODEL = "tiny"
AS_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@contextlib.contextmanager
def open_file_soft_limit(limit: int):
    """Processes started inside inherit this soft limit on open files (the common 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    # Steps of at least 3 ms: a long request is still running when the client hangs up.
    with open_file_soft_limit(1024):
        srv = LocalServer([str(model), "--kv-cache-memory", str(KV), "--served-model-name",
                           MODEL, "--chat-template", str(template),
                           "--worker-cls", "serving_helpers.SlowWorker"],
                          env=server_env(FLEETLLM_TEST_STEP_DELAY="0.003"))
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model, kv_cache_memory=KV) as llm:
        yield llm


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_models_version_tokenize(server, client):
    [card] = client.models.list().data
    assert card.id == MODEL
    assert httpx.get(f"{server.url}/version").json()["version"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "def f(x):"}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "def f(x):"


def test_greedy_completions_equal_llm_generate(client, llm):
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os\n"]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                     logprobs=0, extra_body={**AS_IDS, "ignore_eos": True})
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, out in zip(resp.choices, ref, strict=True):
        assert token_ids(choice.logprobs.tokens) == out.outputs[0].token_ids
        assert choice.text == out.outputs[0].text and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 36
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)


def test_streaming_completions_equal_non_streaming_n2_echo_logprobs(client):
    kwargs = dict(model=MODEL, prompt=["def f(x):", "import sys"], n=2, max_tokens=10,
                  temperature=0.9, seed=11, logprobs=2, echo=True, extra_body=AS_IDS)
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**kwargs, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    for c in whole.choices:
        assert texts[c.index] == c.text and tokens[c.index] == c.logprobs.tokens
        assert finish[c.index] == c.finish_reason
        assert c.logprobs.token_logprobs[0] is None  # echo: the first prompt token
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs[1:])
    assert whole.choices[2].text.startswith("import sys")
    assert usage.completion_tokens == whole.usage.completion_tokens == 40


def test_chat_greedy_equals_llm_generate_streaming_and_not(server, client, llm):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "def fibonacci(n):"}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={**AS_IDS, "ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    [choice] = resp.choices
    assert token_ids([t.token for t in choice.logprobs.content]) == ref.token_ids
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert choice.logprobs.content[0].top_logprobs[0].logprob == \
        choice.logprobs.content[0].logprob  # greedy: the top token is the chosen one
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_n2_seeded_streams_equal_non_streaming(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], n=2,
                  max_tokens=8, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**kwargs)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in whole.choices}


def test_64_concurrent_streams_complete_and_match_non_streaming(server):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(64)]

    async def one(client: httpx.AsyncClient, prompt: list[int], stream: bool):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}
                if stream else None, "logprobs": 0, **AS_IDS}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], token_ids(choice["logprobs"]["tokens"]), None
        text, toks, usage = "", [], None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    text += c["text"]
                    toks += token_ids(c["logprobs"]["tokens"])
        return text, toks, usage

    async def run():
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as c:
            streamed = await asyncio.gather(*(one(c, p, True) for p in prompts))
            whole = await asyncio.gather(*(one(c, p, False) for p in prompts))
        return streamed, whole

    streamed, whole = asyncio.run(run())
    for (text, toks, usage), (ref_text, ref_toks, _) in zip(streamed, whole, strict=True):
        assert len(toks) == 16 and usage["completion_tokens"] == 16
        assert toks == ref_toks and text == ref_text


def scrape(server) -> dict:
    return metric_values(httpx.get(f"{server.url}/metrics").text)


def test_client_disconnect_aborts_and_frees_kv_blocks(server):
    before = scrape(server)
    assert metric(before, "fleetllm:kv_cache_usage_perc") == 0.0
    body = {"model": MODEL, "prompt": [7] * 30, "max_tokens": 900, "ignore_eos": True,
            "n": 2, "temperature": 1.0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            # Hold the iterator: abandoning httpx's line iterator closes the connection.
            lines = r.iter_lines()
            events = 0
            while events < 4:
                line = next(lines)
                assert "error" not in line, line
                events += line.startswith("data: ")
            during = scrape(server)
            assert metric(during, "fleetllm:kv_cache_usage_perc") > 0
            assert metric(during, "fleetllm:num_requests_running") == 1
        # Leaving the block closed the connection mid-stream.
        t0 = time.monotonic()
        while True:
            after = scrape(server)
            if metric(after, "fleetllm:kv_cache_usage_perc") == 0.0 and \
                    metric(after, "fleetllm:num_requests_running") == 0:
                break
            assert time.monotonic() - t0 < 1.0, after
            time.sleep(0.02)
    aborted = ("fleetllm:request_success_total", {"finished_reason": "abort"})
    assert metric(after, aborted[0], **aborted[1]) == metric(before, aborted[0],
                                                             **aborted[1]) + 1
    generated = metric(after, "fleetllm:generation_tokens_total") - \
        metric(before, "fleetllm:generation_tokens_total")
    assert 0 < generated < 2 * 900


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    body = {"model": MODEL, "prompt": [9] * 20, "max_tokens": 900, "ignore_eos": True,
            "n": 2, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection on a timeout
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    t0 = time.monotonic()
    while True:
        values = scrape(server)
        if metric(values, "fleetllm:kv_cache_usage_perc") == 0.0 and \
                metric(values, "fleetllm:num_requests_running") == 0:
            break
        assert time.monotonic() - t0 < 1.0, values
        time.sleep(0.02)


def test_metrics_move_by_exactly_the_expected_amounts(server, client):
    before = scrape(server)
    lengths = [5, 7, 9]
    for n in lengths:
        client.completions.create(model=MODEL, prompt=list(range(10, 10 + n)), max_tokens=4,
                                  extra_body={"ignore_eos": True})
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": [
        {"role": "user", "content": "hi"}]}).json()["tokens"]
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                "content": "hi"}],
                                        n=2, max_tokens=3, stream=True,
                                        extra_body={"ignore_eos": True}))
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("fleetllm:prompt_tokens_total") == sum(lengths) + len(chat_ids)
    assert delta("fleetllm:generation_tokens_total") == 3 * 4 + 2 * 3
    assert delta("fleetllm:request_success_total", finished_reason="length") == 4
    assert delta("fleetllm:request_success_total", finished_reason="stop") == 0
    assert delta("fleetllm:time_to_first_token_seconds_count") == 4
    assert delta("fleetllm:inter_token_latency_seconds_count") == 3 * 3 + 2
    assert delta("fleetllm:e2e_request_latency_seconds_count") == 4
    assert delta("fleetllm:request_queue_time_seconds_count") == 4
    assert delta("fleetllm:e2e_request_latency_seconds_sum") > 0
    assert metric(after, "fleetllm:num_requests_running") == 0
    assert metric(after, "fleetllm:num_requests_waiting") == 0


def test_prefix_cache_metrics_count_a_repeated_prompt(server, client):
    """The second of two identical 40-token prompts finds its two full blocks (block size
    16; the last token is always computed) in the prefix cache, and /metrics says so."""
    before = scrape(server)
    prompt = list(range(300, 340))  # no other test sends these tokens
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)
    queries = metric(after, "fleetllm:prefix_cache_queries_total") - \
        metric(before, "fleetllm:prefix_cache_queries_total")
    hits = metric(after, "fleetllm:prefix_cache_hits_total") - \
        metric(before, "fleetllm:prefix_cache_hits_total")
    assert (queries, hits) == (2 * 40, 32)
    rate = metric(after, "fleetllm:prefix_cache_hit_rate")
    assert rate == metric(after, "fleetllm:prefix_cache_hits_total") / \
        metric(after, "fleetllm:prefix_cache_queries_total")


def test_errors_reach_the_openai_client_typed(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-0", messages=[{"role": "user",
                                                                 "content": "x"}])
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_bench_serve_runs_against_the_server(server, tmp_path):
    from fleetllm.benchmarks.serve import main

    out = tmp_path / "result.json"
    result = main(["--base-url", server.url, "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "5", "--request-rate", "50", "--json", str(out), "--quiet"])
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30
    assert json.loads(out.read_text())["median_ttft_ms"] > 0


def test_bench_serve_chat_endpoint(server):
    from fleetllm.benchmarks.serve import main

    result = main(["--base-url", server.url, "--endpoint", "/v1/chat/completions",
                   "--num-prompts", "4", "--input-len", "8", "--output-len", "5", "--quiet"])
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 20 and result["median_ttft_ms"] > 0


def test_the_server_raises_its_open_file_soft_limit(server):
    """Started with a soft limit of 1024 (see the fixture): it serves with the hard one."""
    limits = (Path("/proc") / str(server.pid) / "limits").read_text()
    [line] = [x for x in limits.splitlines() if x.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    assert soft == hard, line
    assert "raised the open-file limit from 1024" in server.log()
