"""`fleetllm proxy` in front of real `fleetllm serve` instances on loopback: a kv_producer and
a kv_consumer sharing a SharedStorageConnector store give one instance's tokens (greedy,
seeded, streamed, chat); a consumer that cannot load turns `fail` into an error response and
`recompute` into the right tokens; round robin over two decode instances, one of which dies:
a clear error, and the next request is served (issue 74)."""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest
from kv_transfer_helpers import store_config
from serving_helpers import CHAT_TEMPLATE, KV, metric, metric_values, server_env, serving

from fleetllm.entrypoints.openai.local_server import LocalServer

PROMPT = list(range(3, 100))  # 6 whole blocks of 16 before its last token
BS = 16
TIMEOUT = httpx.Timeout(60.0)


def serve(model, template, *extra: str, slow: bool = False) -> LocalServer:
    """`slow`: steps of at least 3 ms, so a long request is still running when its client
    hangs up."""
    slow_args = ["--worker-cls", "serving_helpers.SlowWorker"] if slow else []
    return LocalServer([str(model), "--kv-cache-memory", str(KV), "--served-model-name", "m",
                        "--chat-template", str(template), *slow_args, *extra],
                       env=server_env(FLEETLLM_TEST_STEP_DELAY="0.003"))


def kv_args(store, role: str, policy: str = "recompute") -> list[str]:
    return ["--kv-transfer-config", json.dumps({**store_config(store, policy),
                                                "kv_role": role})]


def proxy(prefill: list[str], decode: list[str], *extra: str) -> LocalServer:
    cmd = [sys.executable, "-m", "fleetllm.cli", "proxy", "--port", "0", "--prefill",
           *prefill, "--decode", *decode, *extra]
    return LocalServer([], env=server_env(), command=cmd, startup_timeout=60,
                       ready_prefix="fleetllm proxy: listening on ")


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    """{name: LocalServer}: "one" (no connector), "producer" and "consumer" (store A),
    "failing" (a kv_consumer of store B, kv_load_failure_policy fail), and the store A."""
    model = tiny_models["llama_gqa"]
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    store_a, store_b = tmp_path_factory.mktemp("store_a"), tmp_path_factory.mktemp("store_b")
    started = {}
    try:
        started["one"] = serve(model, template)
        started["producer"] = serve(model, template, *kv_args(store_a, "kv_producer"))
        started["consumer"] = serve(model, template, *kv_args(store_a, "kv_consumer"),
                                    slow=True)
        started["failing"] = serve(model, template, *kv_args(store_b, "kv_consumer", "fail"))
        yield {**started, "store": store_a}
    finally:
        for srv in started.values():
            srv.stop(timeout=30)


@pytest.fixture(scope="module")
def front(servers):
    with serving(proxy([servers["producer"].url], [servers["consumer"].url])) as srv:
        yield srv


def completion(url: str, seed: int | None = None, stream: bool = False, **body) -> dict:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
            "temperature": 0 if seed is None else 0.9, "seed": seed, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stream": stream, **body}


def tokens(url: str, **kw) -> list[str]:
    r = httpx.post(f"{url}/v1/completions", json=completion(url, **kw), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def streamed_tokens(url: str, **kw) -> list[str]:
    out = []
    with httpx.stream("POST", f"{url}/v1/completions", json=completion(url, stream=True, **kw),
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out += chunk["choices"][0]["logprobs"]["tokens"]
    return out


def kv_counters(srv: LocalServer) -> dict[str, float]:
    values = metric_values(httpx.get(f"{srv.url}/metrics", timeout=TIMEOUT).text)
    return {key: metric(values, f"fleetllm:kv_transfer_{key}_total") for key in
            ("requests_loaded", "blocks_loaded", "bytes_loaded", "requests_saved",
             "blocks_saved", "bytes_saved", "load_failures")}


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_the_proxy_gives_one_instances_tokens(servers, front, seed):
    prompt = [t + (seed or 0) for t in PROMPT]  # new to both instances' caches
    before = {name: kv_counters(servers[name]) for name in ("producer", "consumer")}
    reference = tokens(servers["one"].url, seed=seed, prompt=prompt)
    assert tokens(front.url, seed=seed, prompt=prompt) == reference
    assert streamed_tokens(front.url, seed=seed, prompt=prompt) == reference
    after = {name: kv_counters(servers[name]) for name in ("producer", "consumer")}
    moved = {name: {k: after[name][k] - before[name][k] for k in after[name]}
             for name in after}
    # The first prefill leg wrote the prompt's whole blocks, the first decode leg read them;
    # the second legs found them in the store and the local prefix cache.
    blocks = len(prompt) // BS
    assert moved["producer"]["requests_saved"] == 1
    assert moved["producer"]["blocks_saved"] == blocks
    assert moved["consumer"]["requests_loaded"] == 1
    assert moved["consumer"]["blocks_loaded"] == (len(prompt) - 1) // BS
    assert moved["consumer"]["bytes_loaded"] == \
        moved["producer"]["bytes_saved"] * ((len(prompt) - 1) // BS) / blocks > 0
    assert moved["consumer"]["load_failures"] == 0
    assert moved["consumer"]["blocks_saved"] == 0  # a kv_consumer writes nothing


def test_the_legs_report_their_kv_transfer_params(servers):
    body = completion("", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    r = httpx.post(f"{servers['producer'].url}/v1/completions", json=body, timeout=TIMEOUT)
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"]) == len(PROMPT) // BS
    r = httpx.post(f"{servers['consumer'].url}/v1/completions",
                   json=completion("", kv_transfer_params=params), timeout=TIMEOUT)
    assert "kv_transfer_params" not in r.json()
    assert r.json()["choices"][0]["logprobs"]["tokens"] == tokens(servers["one"].url)


def test_chat_through_the_proxy(servers, front):
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 20}],
            "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    answers = [httpx.post(f"{u}/v1/chat/completions", json=body, timeout=TIMEOUT)
               for u in (servers["one"].url, front.url)]
    assert [a.status_code for a in answers] == [200, 200]
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[1]
    assert answers[1].json()["usage"]["completion_tokens"] == 6


def test_a_load_failure_on_the_decode_leg(servers):
    """The failing consumer's store lacks the blocks: `fail` is an error response; a consumer
    given params for blocks its store lacks under `recompute` computes the right tokens."""
    with serving(proxy([servers["producer"].url], [servers["failing"].url])) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json=completion(srv.url), timeout=TIMEOUT)
    assert r.status_code == 500
    assert "could not be loaded" in r.json()["error"]["message"]
    assert kv_counters(servers["failing"])["load_failures"] == 1
    missing = {"do_remote_prefill": True, "remote_block_ids": list(range(6))}
    prompt = list(range(200, 300))  # never stored
    reference = tokens(servers["one"].url, prompt=prompt)
    assert tokens(servers["consumer"].url, prompt=prompt,
                  kv_transfer_params=missing) == reference


def test_round_robin_and_a_decode_instance_that_dies(servers, tiny_models, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    doomed = serve(tiny_models["llama_gqa"], template)
    try:
        with serving(proxy([servers["producer"].url],
                           [doomed.url, servers["consumer"].url], "--timeout", "30")) as srv:
            reference = tokens(servers["one"].url)
            # in turn: doomed (no connector: computes the prompt itself), consumer
            assert tokens(srv.url) == reference
            assert tokens(srv.url) == reference
            doomed.kill()
            r = httpx.post(f"{srv.url}/v1/completions", json=completion(srv.url),
                           timeout=TIMEOUT)
            assert r.status_code == 502
            assert doomed.url in r.json()["error"]["message"]
            assert "decode" in r.json()["error"]["message"]
            assert tokens(srv.url) == reference  # the next one: the consumer
            health = httpx.get(f"{srv.url}/health", timeout=TIMEOUT)
            assert health.status_code == 200  # one decode instance is enough to serve
            assert health.json()["decode"][servers["consumer"].url] == "ok"
            assert doomed.url in health.json()["decode"][doomed.url]  # the error names it
    finally:
        doomed.kill()


def running(srv: LocalServer) -> float:
    values = metric_values(httpx.get(f"{srv.url}/metrics", timeout=TIMEOUT).text)
    return metric(values, "fleetllm:num_requests_running")


def aborted(srv: LocalServer) -> float:
    values = metric_values(httpx.get(f"{srv.url}/metrics", timeout=TIMEOUT).text)
    return metric(values, "fleetllm:request_success_total", finished_reason="abort")


def wait_idle(srv: LocalServer, within: float) -> None:
    deadline = time.monotonic() + within
    while running(srv):
        assert time.monotonic() < deadline, "the decode leg still runs"
        time.sleep(0.05)


def test_a_client_that_leaves_aborts_the_decode_leg(servers, front):
    consumer = servers["consumer"]
    before = aborted(consumer)
    body = completion(front.url, stream=True, max_tokens=500)
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", f"{front.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()  # held: abandoning it closes the connection
            events = 0
            while events < 4:
                events += next(lines).startswith("data: ")
            assert running(consumer) == 1
    wait_idle(consumer, 2.0)
    with pytest.raises(httpx.ReadTimeout):  # a plain request the client gives up on
        httpx.post(f"{front.url}/v1/completions", timeout=1.5,
                   json=completion(front.url, max_tokens=500))
    wait_idle(consumer, 2.0)
    assert aborted(consumer) == before + 2
