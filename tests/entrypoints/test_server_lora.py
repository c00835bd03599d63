"""LoRA adapters on the server (issue #22): /v1/models lists them, a request's `model` picks
one (its tokens are offline LLM.generate's with the same LoRARequest, streamed or not), an
unknown name is vLLM's 404, runtime load/unload only with --allow-runtime-lora-updating, the
lora_requests_info gauge; in-process (AsyncLLMEngine) and over the engine-core process
(`fleetllm serve` with EngineCoreClient). Adapters are made with PEFT 0.21 here."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
import torch
from serving_helpers import (
    CHAT_TEMPLATE,
    KV,
    AppClient,
    assert_error,
    metric_values,
    server_env,
)

from fleetllm import LLM, SamplingParams
from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.engine.llm_engine import LLMEngine
from fleetllm.engine.stats import EngineLoad
from fleetllm.entrypoints.openai.api_server import build_app
from fleetllm.entrypoints.openai.cli_args import LoRAModulePath, add_serve_args
from fleetllm.entrypoints.openai.local_server import LocalServer, ServerStartError
from fleetllm.entrypoints.openai.metrics import PrometheusMetrics
from fleetllm.lora.request import LoRARequest

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=KV,
            max_model_len=256)
PROMPTS = [[1, 5, 9, 200, 37, 11], [1, 40, 41, 42], [1, 300, 7]]
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
# Each choice's tokens as ids, read from its logprobs ("token_id:N").
IDS = dict(logprobs=0, return_tokens_as_token_ids=True)
CHAT_MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


def make_peft_adapter(model_dir, path, seed: int, targets: list[str], r: int = 8):
    """A PEFT LoRA adapter for the checkpoint, saved as PEFT saves it; random A and B
    (init_lora_weights=False: B is not zero) so it changes the outputs."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                            init_lora_weights=False))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_peft_adapter(model, root / "a", 1, ["q_proj", "k_proj", "v_proj",
                                                          "o_proj"]),
            "b": make_peft_adapter(model, root / "b", 2, ["gate_proj", "down_proj"], r=4),
            "c": make_peft_adapter(model, root / "c", 3, ["v_proj", "up_proj"])}


@pytest.fixture(scope="module")
def offline(model, adapters):
    """Offline LLM.generate's greedy tokens and chat text per model name ("tiny": base)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    # As the server renders a chat: the template's text, tokenized without special tokens.
    chat_ids = tok.encode(tok.apply_chat_template(
        CHAT_MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
        tokenize=False), add_special_tokens=False)
    ids = {"tiny": None, **{n: LoRARequest(n, 100 + i, p)
                            for i, (n, p) in enumerate(adapters.items())}}
    out = {}
    with LLM(str(model), **LORA) as llm:
        for name, lora in ids.items():
            outs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, chat_ids]],
                                SamplingParams(**GREEDY), use_tqdm=False, lora_request=lora)
            out[name] = [o.outputs[0].token_ids for o in outs[:-1]], outs[-1].outputs[0].text
    return out


@pytest.fixture(scope="module")
def engine(model):
    eng = AsyncLLMEngine.from_engine_args(str(model), **LORA)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def app(engine, adapters):
    modules = [LoRAModulePath("a", adapters["a"]),
               LoRAModulePath("b", adapters["b"], base_model_name="tiny-base")]
    fastapi_app = build_app(engine, ["tiny", "tiny-alias"], chat_template=CHAT_TEMPLATE,
                            lora_modules=modules, allow_runtime_lora_updating=True)
    client = AppClient(fastapi_app)
    client.run(fastapi_app.state.models.init_static_loras())
    yield client
    client.close()


def completion(app, model: str):
    r = app.request("POST", "/v1/completions",
                    json={"model": model, "prompt": PROMPTS, **GREEDY, **IDS})
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(choices: list) -> list[list[int]]:
    """The ids of each choice (dicts or the openai client's objects), by index."""
    def get(c, key):
        return c[key] if isinstance(c, dict) else getattr(c, key)
    return [[int(t.split(":")[1]) for t in get(get(c, "logprobs"), "tokens")]
            for c in sorted(choices, key=lambda c: get(c, "index"))]


def streamed(app, path: str, body: dict) -> list[dict]:
    async def read():
        chunks = []
        async with app.client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return chunks
    return app.run(read())


def test_models_lists_adapters_with_parent_and_root(app, adapters, model):
    cards = {c["id"]: c for c in app.request("GET", "/v1/models").json()["data"]}
    assert list(cards) == ["tiny", "tiny-alias", "a", "b"]
    assert cards["tiny"]["root"] == str(model) and cards["tiny"]["parent"] is None
    assert cards["a"]["root"] == adapters["a"] and cards["a"]["parent"] == "tiny"
    assert cards["b"]["parent"] == "tiny-base"  # the JSON form's base_model_name


def test_adapter_by_name_gives_offline_tokens(app, offline):
    for name in ("a", "b", "tiny", "tiny-alias"):
        body = completion(app, name)
        assert token_ids(body["choices"]) == offline[name.split("-")[0]][0], name
        assert body["model"] == (name if name in ("a", "b") else "tiny")
    assert offline["a"][0] != offline["tiny"][0] != offline["b"][0]


def test_streaming_and_chat_with_an_adapter(app, offline):
    chunks = streamed(app, "/v1/completions", {"model": "a", "prompt": PROMPTS, **GREEDY,
                                               **IDS})
    assert {c["model"] for c in chunks} == {"a"}
    tokens: dict[int, list[int]] = {}
    for c in chunks:
        for choice in c["choices"]:
            tokens.setdefault(choice["index"], []).extend(
                int(t.split(":")[1]) for t in choice["logprobs"]["tokens"])
    assert [tokens[i] for i in range(len(PROMPTS))] == offline["a"][0]
    for name in ("b", "tiny"):
        r = app.request("POST", "/v1/chat/completions",
                        json={"model": name, "messages": CHAT_MESSAGES, **GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == offline[name][1]
        assert r.json()["model"] == name
        chunks = streamed(app, "/v1/chat/completions",
                          {"model": name, "messages": CHAT_MESSAGES, **GREEDY})
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text == offline[name][1] and {c["model"] for c in chunks} == {name}


def test_unknown_model_is_vllms_404(app):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": CHAT_MESSAGES})):
        r = app.request("POST", path, json={"model": "nope", **body, "stream": True})
        error = assert_error(r, 404, "model")
        assert error["message"] == "The model `nope` does not exist."


def test_runtime_load_and_unload(app, adapters, offline):
    load = {"lora_name": "c", "lora_path": adapters["c"]}
    r = app.request("POST", "/v1/load_lora_adapter", json=load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    assert "c" in [c["id"] for c in app.request("GET", "/v1/models").json()["data"]]
    assert token_ids(completion(app, "c")["choices"]) == offline["c"][0]
    assert_error(app.request("POST", "/v1/load_lora_adapter", json=load), 400, "lora_name")
    for name in ("a", "tiny"):  # a served name is taken too
        assert_error(app.request("POST", "/v1/load_lora_adapter",
                                 json={**load, "lora_name": name}), 400)
    bad = assert_error(app.request("POST", "/v1/load_lora_adapter",
                                   json={"lora_name": "d", "lora_path": "/no/such/dir"}), 400)
    assert "/no/such/dir" in bad["message"]
    assert_error(app.request("POST", "/v1/load_lora_adapter", json={"lora_name": "d"}), 400,
                 "lora_path")
    r = app.request("POST", "/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    assert "c" not in [c["id"] for c in app.request("GET", "/v1/models").json()["data"]]
    assert_error(app.request("POST", "/v1/completions", json={"model": "c", "prompt": "x"}),
                 404, "model")
    # vLLM's NotFoundError for an adapter it does not have
    assert_error(app.request("POST", "/v1/unload_lora_adapter", json={"lora_name": "c"}), 404,
                 "lora_name")
    # Loaded again: a new id (the engine caches by id), the same tokens.
    assert app.request("POST", "/v1/load_lora_adapter", json=load).status_code == 200
    assert models_of(app).lora_requests["c"].lora_int_id == 4
    assert token_ids(completion(app, "c")["choices"]) == offline["c"][0]
    assert app.request("POST", "/v1/unload_lora_adapter",
                       json={"lora_name": "c"}).status_code == 200


def models_of(app: AppClient):
    return app.client._transport.app.state.models


def test_random_loads_unloads_and_requests_match_a_model(model, adapters, offline):
    """A randomized differential test of the server's adapter table: after any sequence of
    loads, unloads and requests, /v1/models, the status codes, the ids and every request's
    tokens are what a plain dict of name -> adapter predicts. (An engine of its own: ids
    are the server's to give, one table per engine.)"""
    engine = AsyncLLMEngine.from_engine_args(str(model), **LORA)
    fastapi_app = build_app(engine, ["tiny"], allow_runtime_lora_updating=True)
    client = AppClient(fastapi_app)
    rng = random.Random(22)
    table: dict[str, str] = {}  # name -> adapter (a, b, c), in load order
    ids: dict[str, int] = {}
    loads = 0
    try:
        for _ in range(40):
            op = rng.choice(["load", "load", "unload", "request", "request"])
            name = rng.choice(["x", "y", "z", "tiny"])
            if op == "load":
                key = rng.choice("abc")
                r = client.request("POST", "/v1/load_lora_adapter",
                                   json={"lora_name": name, "lora_path": adapters[key]})
                if name in table or name == "tiny":
                    assert_error(r, 400, "lora_name")
                else:
                    assert r.status_code == 200, r.text
                    table[name] = key
                    loads += 1
                    ids[name] = fastapi_app.state.models.lora_requests[name].lora_int_id
                    assert ids[name] == loads  # 1, 2, ...: never an id used before
            elif op == "unload":
                r = client.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
                if name in table:
                    assert r.status_code == 200, r.text
                    del table[name]
                else:
                    assert_error(r, 404, "lora_name")  # a served name is no adapter
            else:
                r = client.request("POST", "/v1/completions", json={
                    "model": name, "prompt": PROMPTS[0], **GREEDY, **IDS})
                if name == "tiny" or name in table:
                    assert r.status_code == 200, r.text
                    want = offline["tiny" if name == "tiny" else table[name]][0][0]
                    assert token_ids(r.json()["choices"]) == [want]
                else:
                    assert_error(r, 404, "model")
            cards = client.request("GET", "/v1/models").json()["data"]
            assert [c["id"] for c in cards] == ["tiny", *table]
            assert [c["root"] for c in cards[1:]] == [adapters[k] for k in table.values()]
        assert loads >= 3 and 0 < len(table)  # the sequence did exercise the table
    finally:
        client.close()
        engine.shutdown()


def test_runtime_updating_is_off_by_default(engine, adapters):
    client = AppClient(build_app(engine, ["tiny"], lora_modules=[
        LoRAModulePath("a", adapters["a"])]))
    try:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "c",
                                                       "lora_path": adapters["c"]}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"})):
            assert_error(client.request("POST", path, json=body), 404)
    finally:
        client.close()


def test_lora_requests_info_gauge(app):
    from prometheus_client.parser import text_string_to_metric_families

    text = app.request("GET", "/metrics").text
    [idle] = [s for f in text_string_to_metric_families(text)
              if f.name == "fleetllm:lora_requests_info" for s in f.samples]
    assert idle.labels == {"max_lora": "2", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    assert abs(idle.value - time.time()) < 60  # vLLM's value: when the snapshot was taken


def test_load_names_running_and_waiting_adapters(model, adapters):
    """EngineLoad (what /metrics renders, over the wire too) names the adapters of running
    and of waiting requests; the gauge keeps only the current label set."""
    engine = LLMEngine.from_engine_args(str(model), **{**LORA, "max_loras": 1})
    try:
        for i, name in enumerate(("b", "a", "b")):
            engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[0]},
                               SamplingParams(max_tokens=4, ignore_eos=True),
                               lora_request=LoRARequest(name, 1 + (name == "a"),
                                                        adapters[name]))
        engine.step()  # max_loras=1: b's requests run, a's waits for a slot
        load = EngineLoad.of(engine)
        assert (load.running_lora_adapters, load.waiting_lora_adapters) == ("b", "a")
        metrics = PrometheusMetrics("tiny", max_loras=1)
        metrics.render(EngineLoad(running_lora_adapters="a,b", taken_at=5.0))
        values = metric_values(metrics.render(load).decode())
        [(key, value)] = [(k, v) for k, v in values.items()
                          if k[0] == "fleetllm:lora_requests_info"]
        assert dict(key[1]) == {"max_lora": "1", "running_lora_adapters": "b",
                                "waiting_lora_adapters": "a"}
        assert value == load.taken_at
    finally:
        engine.shutdown()


def test_lora_metric_absent_without_enable_lora(tiny_models):
    eng = AsyncLLMEngine.from_engine_args(str(tiny_models["llama_gqa"]), kv_cache_memory=KV,
                                          max_model_len=256)
    client = AppClient(build_app(eng, ["tiny"]))
    try:
        assert "lora_requests_info" not in client.request("GET", "/metrics").text
        assert_error(client.request("POST", "/v1/completions",
                                    json={"model": "a", "prompt": "hi"}), 404, "model")
    finally:
        client.close()
        eng.shutdown()


def test_lora_modules_flag_forms():
    import argparse

    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lora-modules", "a=/x/a",
                              '{"name": "b", "path": "/x/b", "base_model_name": "m"}',
                              '{"name": "c", "path": "/x/c"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/x/a"), LoRAModulePath("b", "/x/b", "m"),
                                 LoRAModulePath("c", "/x/c")]
    assert not parser.parse_args([]).allow_runtime_lora_updating
    for bad in ("a", "=/x", "a=", '{"name": "a"}', '{"name": "a", "path": "/p", "x": 1}',
                "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--lora-modules", bad])


def test_serve_over_the_engine_core_process(model, adapters, offline, tmp_path):
    """`fleetllm serve` (engine-core process): the openai client picks adapters by name,
    streams, loads and unloads at run time; the metric comes over the wire."""
    from openai import NotFoundError, OpenAI

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = LocalServer([str(model), "--served-model-name", "tiny", "--chat-template",
                          str(template), "--kv-cache-memory", str(KV), "--max-model-len", "256",
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", f"a={adapters['a']}",
                          json.dumps({"name": "b", "path": adapters["b"]}),
                          "--allow-runtime-lora-updating"], env=server_env())
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x")
        assert [m.id for m in client.models.list()] == ["tiny", "a", "b"]
        ids = dict(temperature=0, max_tokens=8, logprobs=0,
                   extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        for name in ("a", "b", "tiny"):
            out = client.completions.create(model=name, prompt=PROMPTS, **ids)
            assert token_ids(out.choices) == offline[name][0] and out.model == name
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="b", messages=CHAT_MESSAGES, stream=True, temperature=0, max_tokens=8,
            extra_body={"ignore_eos": True}) if c.choices)
        assert text == offline["b"][1]
        with pytest.raises(NotFoundError, match="The model `nope` does not exist."):
            client.completions.create(model="nope", prompt="hi")
        r = client.post("/load_lora_adapter", cast_to=str,
                        body={"lora_name": "c", "lora_path": adapters["c"]})
        assert r == "Success: LoRA adapter 'c' added successfully."
        out = client.completions.create(model="c", prompt=PROMPTS, **ids)
        assert token_ids(out.choices) == offline["c"][0]
        client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "c"})
        assert [m.id for m in client.models.list()] == ["tiny", "a", "b"]
        with urllib.request.urlopen(f"{server.url}/metrics") as r:
            metrics = r.read().decode()
        assert 'fleetllm:lora_requests_info{max_lora="2"' in metrics
    finally:
        server.stop()


def test_serve_refuses_a_bad_adapter_at_start(model, tmp_path):
    with pytest.raises(ServerStartError, match="adapter_config.json"):
        LocalServer([str(model), "--kv-cache-memory", str(KV), "--enable-lora",
                     "--lora-modules", f"bad={tmp_path}"], env=server_env(),
                    startup_timeout=120)
    with pytest.raises(ServerStartError, match="--lora-modules needs --enable-lora"):
        LocalServer([str(model), "--lora-modules", f"a={tmp_path}"], env=server_env(),
                    startup_timeout=60)
