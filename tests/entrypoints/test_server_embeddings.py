"""POST /v1/embeddings on a real `fleetllm serve` of a pooling model, with the official openai
client (issue #21): float and base64 vectors equal each other and LLM.embed's, a batch of 64
inputs in one request runs as one batch, token-id inputs, Matryoshka `dimensions`, vLLM's
`normalize` and `truncate_prompt_tokens`, bad inputs and task mismatches as 400s in the error
shape, metrics. With the engine-core process (default) and --disable-frontend-multiprocessing.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from serving_helpers import (
    KV,
    assert_error,
    make_embed_checkpoint,
    metric,
    metric_values,
    server_env,
    stop_cleanly,
)
from transformers import AutoTokenizer

from fleetllm import LLM
from fleetllm.entrypoints.openai.local_server import LocalServer
from fleetllm.pooling_params import PoolingParams

pytestmark = pytest.mark.timeout(300)
NAME = "emb"
TEXTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys", "hello world"]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    return make_embed_checkpoint(tmp_path_factory.mktemp("embed") / "model")


@pytest.fixture(scope="module")
def tokenizer(embed_model):
    return AutoTokenizer.from_pretrained(embed_model)


@pytest.fixture(scope="module")
def llm(embed_model):
    with LLM(embed_model, task="embed", kv_cache_memory=KV) as llm:
        yield llm


def embed(llm: LLM, prompts, params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, params,
                                                                 use_tqdm=False)])


def close(got, expected: torch.Tensor) -> None:
    """Vectors batched differently differ in the last bits only."""
    torch.testing.assert_close(torch.as_tensor(np.asarray(got, dtype=np.float32)), expected,
                               rtol=1e-5, atol=1e-6)


def start(args: list[str], tmp_path_factory, **env: str) -> LocalServer:
    log = tmp_path_factory.mktemp("batches") / "steps.log"
    srv = LocalServer([*args, "--kv-cache-memory", str(KV), "--worker-cls",
                       "serving_helpers.BatchLoggingWorker"],
                      env=server_env(FLEETLLM_TEST_STEP_DELAY="0.02",
                                     FLEETLLM_TEST_BATCH_LOG=str(log), **env))
    srv.batch_log = log
    return srv


@pytest.fixture(scope="module", params=["core-process", "in-process"])
def server(embed_model, tmp_path_factory, request):
    # The core process finds the task by itself (a bare LlamaModel); the other is told.
    extra = [] if request.param == "core-process" else \
        ["--task", "embed", "--disable-frontend-multiprocessing"]
    srv = start([str(embed_model), "--served-model-name", NAME, *extra], tmp_path_factory)
    try:
        yield srv
    finally:
        stop_cleanly(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_float_and_base64_are_the_same_vectors_as_llm_embed(client, server, llm, tokenizer):
    expected = embed(llm, TEXTS)
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64
    raw = httpx.post(f"{server.url}/v1/embeddings", json={
        "model": NAME, "input": TEXTS, "encoding_format": "base64", "user": "ignored"}).json()
    assert floats.object == "list" and floats.model == NAME
    assert [(d.index, d.object) for d in floats.data] == [(i, "embedding") for i in range(4)]
    as_floats = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert all(isinstance(d["embedding"], str) for d in raw["data"])
    from_b64 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                         for d in raw["data"]])
    np.testing.assert_array_equal(as_floats, from_b64)  # the same float32 values, bit for bit
    np.testing.assert_array_equal(as_floats, np.array([d.embedding for d in default.data],
                                                      dtype=np.float32))
    close(as_floats, expected)
    np.testing.assert_allclose(np.linalg.norm(as_floats, axis=1), 1.0, rtol=1e-5)  # LAST+norm
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (tokens, tokens)
    assert raw["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    one = client.embeddings.create(model=NAME, input=TEXTS[2], encoding_format="float")
    assert len(one.data) == 1
    close([one.data[0].embedding], expected[2:3])


def test_a_batch_of_64_inputs_runs_together_in_order(client, server, llm):
    texts = [f"{TEXTS[i % 4]} {i} " * (1 + i % 7) for i in range(64)]
    expected = embed(llm, texts)
    server.batch_log.write_text("")
    out = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    assert [d.index for d in out.data] == list(range(64))
    close([d.embedding for d in out.data], expected)
    # Added all at once, they share steps (one input per 20 ms step would be 64 steps).
    steps = [int(n) for n in server.batch_log.read_text().split()]
    assert sum(steps) == 64 and len(steps) <= 8, steps


def test_token_id_inputs(client, llm):
    a, b = [5, 17, 300, 42, 9], [100, 200, 3]
    expected = embed(llm, [{"prompt_token_ids": a}, {"prompt_token_ids": b}])
    single = client.embeddings.create(model=NAME, input=a, encoding_format="float")
    both = client.embeddings.create(model=NAME, input=[a, b], encoding_format="float")
    close([single.data[0].embedding], expected[:1])
    close([d.embedding for d in both.data], expected)
    assert both.usage.prompt_tokens == len(a) + len(b)


def test_vllm_extras_normalize_and_truncate_prompt_tokens(client, llm):
    ids = list(range(10, 40))
    raw = client.embeddings.create(model=NAME, input=[ids], encoding_format="float",
                                   extra_body={"normalize": False})
    close([raw.data[0].embedding], embed(llm, {"prompt_token_ids": ids},
                                         PoolingParams(normalize=False)))
    assert abs(np.linalg.norm(raw.data[0].embedding) - 1.0) > 1e-3
    cut = client.embeddings.create(model=NAME, input=[ids], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 8})
    close([cut.data[0].embedding], embed(llm, {"prompt_token_ids": ids[-8:]}))
    assert cut.usage.prompt_tokens == 8


def test_dimensions_are_refused_on_a_model_without_matryoshka(client, server):
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=NAME, input="hi", dimensions=16)
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a", "b"], "dimensions": 16})
    assert_error(r, 400, "dimensions")


BAD_BODIES = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["ok", ""]}, "input.1"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[1, 2], [-1]]}, "input"),
    ({"input": [999999]}, "input"),
    ({"input": list(range(3, 500)) * 3}, "input"),  # 1491 tokens > max_model_len 1024
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": "16"}, "dimensions"),
    ({"input": "hi", "normalize": "yes"}, "normalize"),
    ({"input": "hi", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hi", "bogus": 1}, "bogus"),
    ({"model": "nope", "input": "hi"}, "model"),
]


def test_bad_inputs_are_400s_in_the_error_shape(server, client):
    for body, param in BAD_BODIES:
        status = 404 if param == "model" else 400
        assert_error(httpx.post(f"{server.url}/v1/embeddings", json=body), status, param)
    assert_error(httpx.post(f"{server.url}/v1/embeddings", content=b"{",
                            headers={"content-type": "application/json"}), 400)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.embeddings.create(model=NAME, input="still fine").data


def test_the_card_says_embed_and_generate_endpoints_say_why_not(server, client, embed_model):
    [card] = client.models.list().data
    assert (card.id, card.task, card.max_model_len, card.root) == (NAME, "embed", 1024,
                                                                     str(embed_model))
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        err = assert_error(httpx.post(f"{server.url}{path}", json=body), 400)
        assert "task 'embed'" in err["message"] and "/v1/embeddings" in err["message"]
    with pytest.raises(openai.BadRequestError, match="--task generate"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}).json()
    assert tokens["count"] > 0  # tokenization serves either task


def test_metrics_count_prompt_tokens_and_no_generated_ones(server, client):
    before = metric_values(httpx.get(f"{server.url}/metrics").text)
    out = client.embeddings.create(model=NAME, input=[[3, 4, 5], [6, 7]], encoding_format="float")
    assert len(out.data) == 2
    after = metric_values(httpx.get(f"{server.url}/metrics").text)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("fleetllm:prompt_tokens_total") == 5
    assert moved("fleetllm:generation_tokens_total") == 0
    assert moved("fleetllm:request_success_total", finished_reason="stop") == 2
    assert moved("fleetllm:e2e_request_latency_seconds_count") == 2


def test_matryoshka_dimensions_and_the_api_key(tmp_path_factory):
    path = make_embed_checkpoint(tmp_path_factory.mktemp("mat") / "model", seed=1,
                                 matryoshka_dimensions=[16, 32])
    with LLM(path, task="embed", kv_cache_memory=KV) as ref:
        expected = embed(ref, TEXTS[:2], PoolingParams(dimensions=16))
    srv = start([str(path), "--served-model-name", NAME, "--api-key", "k3y"],
                tmp_path_factory)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k3y", max_retries=0)
        out = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16)
        assert [len(d.embedding) for d in out.data] == [16, 16]
        close([d.embedding for d in out.data], expected)
        np.testing.assert_allclose(np.linalg.norm([d.embedding for d in out.data], axis=1),
                                   1.0, rtol=1e-5)  # truncated, then normalized
        err = assert_error(httpx.post(f"{srv.url}/v1/embeddings", json={
            "input": "hi", "dimensions": 20}, headers={"authorization": "Bearer k3y"}), 400,
            "dimensions")
        assert "[16, 32]" in err["message"]
        assert_error(httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hi"}), 401)
    finally:
        stop_cleanly(srv)


def test_an_embeddings_request_to_a_generate_server_is_a_400(tiny_models, tmp_path_factory):
    srv = LocalServer([str(tiny_models["llama_gqa"]), "--served-model-name", "gen",
                       "--kv-cache-memory", str(KV)], env=server_env())
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="task 'generate'") as info:
            client.embeddings.create(model="gen", input="hi")
        assert "--task embed" in str(info.value)
        err = assert_error(httpx.post(f"{srv.url}/v1/embeddings", json={"input": [1, 2]}), 400)
        assert "/v1/completions" in err["message"]
        [card] = client.models.list().data
        assert card.task == "generate"
        assert client.completions.create(model="gen", prompt="hi", max_tokens=2).choices
    finally:
        stop_cleanly(srv)
