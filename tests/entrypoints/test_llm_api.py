"""LLM as a vLLM drop-in: prompt_token_ids=, chat(), vLLM-only engine arguments, and what
happens after shutdown()."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.config import EngineConfig
from fleetllm.errors import (
    ConfigurationError,
    EngineShutdownError,
    FleetLLMError,
    InvalidRequestError,
)
from fleetllm.executor import Executor

GREEDY = SamplingParams(temperature=0, max_tokens=4)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# Arguments vLLM scripts pass that change nothing here.
HARMLESS = dict(enforce_eager=True, trust_remote_code=True, tokenizer_mode="auto",
                disable_log_stats=True, disable_custom_all_reduce=True,
                max_seq_len_to_capture=8192, disable_log_requests=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=32 << 20) as llm:
        yield llm


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    """A copy of the tiny checkpoint whose tokenizer has a chat template."""
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_models["llama_gqa"], path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return path


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------- prompt_token_ids=

def test_generate_takes_vllm_prompt_token_ids(llm):
    ids = [[5, 6, 7, 8], [9, 10]]
    ref = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids and token_ids(outs) == token_ids(ref)
    [one] = llm.generate(prompt_token_ids=ids[0], sampling_params=GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == ids[0] and one.outputs[0].token_ids == token_ids(ref)[0]
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate(sampling_params=GREEDY)
    named = llm.generate(["x", "y"], GREEDY, prompt_token_ids=ids, use_tqdm=False)
    assert [o.prompt for o in named] == ["x", "y"] and token_ids(named) == token_ids(ref)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate(["a"], GREEDY, prompt_token_ids=ids)


# ---------------------------------------------------------------- requests that cannot run

@pytest.mark.timeout(120)
def test_more_samples_than_a_steps_token_budget_are_refused_not_hung(tiny_models):
    """n samples decode together, a token each per step: n > max_num_batched_tokens could
    never be scheduled (generate waited for ever); refused at add time, saying why."""
    with LLM(tiny_models["llama_gqa"], max_num_batched_tokens=4, kv_cache_memory=32 << 20
             ) as llm:
        params = SamplingParams(n=8, max_tokens=4)
        with pytest.raises(InvalidRequestError, match="max_num_batched_tokens=4"):
            llm.llm_engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
        [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        assert out.finished and "max_num_batched_tokens" in out.error
        # n up to the budget runs, also with a prompt longer than it (prefilled in chunks)
        [out] = llm.generate({"prompt_token_ids": list(range(5, 25))},
                             SamplingParams(n=4, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
        assert [len(c.token_ids) for c in out.outputs] == [4] * 4


# ---------------------------------------------------------------- chat()

def test_chat_applies_the_tokenizers_template(chat_model):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    rendered = "<system>be brief\n<user>hello\n<assistant>"
    with LLM(chat_model, kv_cache_memory=32 << 20) as llm:
        tok = llm.get_tokenizer()
        [out] = llm.chat(conv, GREEDY, use_tqdm=False)
        assert out.prompt == rendered
        # Tokenized without special tokens: the template writes whatever it needs.
        ids = tok.encode(rendered, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        [ref] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        outs = llm.chat([conv, conv[1:]], GREEDY, add_generation_prompt=False, use_tqdm=False)
        assert [o.prompt for o in outs] == ["<system>be brief\n<user>hello\n", "<user>hello\n"]
        [out] = llm.chat(conv[1:], GREEDY, chat_template="{{ messages[0]['content'] }}!",
                         use_tqdm=False)
        assert out.prompt == "hello!"


def test_chat_takes_vllms_arguments_in_vllms_order(chat_model, tmp_path):
    """LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template,
    chat_template_content_format, add_generation_prompt, continue_final_message, tools,
    chat_template_kwargs, mm_processor_kwargs), as vLLM's."""
    import inspect

    from lora_helpers import lora_request, make_adapter

    assert list(inspect.signature(LLM.chat).parameters)[1:] == [
        "messages", "sampling_params", "use_tqdm", "lora_request", "chat_template",
        "chat_template_content_format", "add_generation_prompt", "continue_final_message",
        "tools", "chat_template_kwargs", "mm_processor_kwargs"]
    conv = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "there"}]}]
    adapter = lora_request(make_adapter(chat_model, tmp_path / "a", seed=3), 1)
    with LLM(chat_model, kv_cache_memory=32 << 20, enable_lora=True, max_lora_rank=8) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        # positional: use_tqdm, lora_request, chat_template
        [out] = llm.chat(conv, params, False, adapter, "{{ messages[0]['content'] }}:")
        assert out.prompt == "hello\nthere:"  # text parts joined, as vLLM's "string"
        [base] = llm.chat(conv, params, False, None, "{{ messages[0]['content'] }}:")
        ids = {"prompt_token_ids": out.prompt_token_ids}
        assert out.outputs[0].token_ids == llm.generate(
            ids, params, use_tqdm=False, lora_request=adapter)[0].outputs[0].token_ids
        assert base.outputs[0].token_ids == llm.generate(
            ids, params, use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter ran
        loops = "{% for p in messages[0]['content'] %}[{{ p['text'] }}]{% endfor %}"
        [out] = llm.chat(conv, params, use_tqdm=False, chat_template=loops)  # auto: openai
        assert out.prompt == "[hello][there]"
        [out] = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                         chat_template=loops, chat_template_content_format="openai")
        assert out.prompt == "[hi]"
        # continue_final_message, tools and chat_template_kwargs reach the template
        template = ("{{ greeting }}{% for t in tools %}<{{ t['name'] }}>{% endfor %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
        [out] = llm.chat([{"role": "assistant", "content": "Once upon"}], params,
                         use_tqdm=False, chat_template=template, add_generation_prompt=False,
                         continue_final_message=True, tools=[{"name": "f"}],
                         chat_template_kwargs={"greeting": "hey "})
        assert out.prompt == "hey <f>Once upon"
        with pytest.raises(InvalidRequestError, match="continue_final_message"):
            llm.chat(conv, params, continue_final_message=True)
        with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
            llm.chat(conv, params, chat_template_content_format="xml")
        with pytest.raises(InvalidRequestError, match="text-only"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_without_a_template_says_so(llm):
    with pytest.raises((ConfigurationError, InvalidRequestError), match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                     chat_template="{{ messages[0]['content'] }}")
    assert out.prompt == "hi"


# ---------------------------------------------------------------- vLLM engine arguments

def test_vllm_engine_args_that_mean_nothing_warn_once_each(tiny_models, caplog):
    caplog.set_level(logging.WARNING)
    EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]), **HARMLESS)
    for name in HARMLESS:
        assert sum(name in r.getMessage() for r in caplog.records) == 1, name
    caplog.clear()
    # vLLM's "off" values of unsupported features are what fleetllm does: no noise.
    EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]), quantization=None,
                             kv_cache_dtype="auto", speculative_model=None, enable_lora=False)
    assert not caplog.records


@pytest.mark.parametrize("kwargs, name", [
    (dict(quantization="awq"), "quantization"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(observability_config={"otlp_traces_endpoint": "x"}), "observability_config"),
    (dict(enable_prompt_adapter=True), "enable_prompt_adapter"),
])
def test_vllm_engine_args_that_would_change_results_are_refused(tiny_models, kwargs, name):
    with pytest.raises(ConfigurationError, match=f"^\\[E005\\] {name}: .*not supported"):
        LLM(tiny_models["llama_gqa"], **kwargs)


def test_llm_accepts_harmless_vllm_args(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=32 << 20, **HARMLESS) as llm:
        [out] = llm.generate("hello", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


# ---------------------------------------------------------------- after shutdown

def test_llm_after_shutdown_raises_engine_shutdown_error(chat_model):
    llm = LLM(chat_model, kv_cache_memory=32 << 20)
    llm.shutdown()
    for call in (lambda: llm.generate("hello", GREEDY, use_tqdm=False),
                 lambda: llm.generate(prompt_token_ids=[5, 6], use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)):
        with pytest.raises(EngineShutdownError, match="shut down") as info:
            call()
        assert info.value.code == "E008" and isinstance(info.value, FleetLLMError)
    llm.shutdown()  # still harmless


def test_uniproc_executor_after_shutdown_raises_engine_shutdown_error(tiny_models):
    cfg = EngineConfig.from_kwargs(model=str(tiny_models["llama_gqa"]),
                                   kv_cache_memory=32 << 20)
    executor = Executor.get_class(cfg)(cfg)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    executor.shutdown()
    for call in (lambda: executor.collective_rpc("check_health"),
                 lambda: executor.collective_rpc(lambda w: 1, timeout=5),
                 lambda: executor.determine_num_available_blocks(),
                 lambda: executor.check_health()):
        with pytest.raises(EngineShutdownError, match="shut down"):
            call()
    # return_exceptions is about the workers' errors; a shut-down executor has none to run.
    with pytest.raises(EngineShutdownError):
        executor.collective_rpc("check_health", return_exceptions=True)
