"""kv_transfer_config: vLLM's keys, checked before any worker starts; a user's own connector by
module path; the --kv-transfer-config flag (issue 74)."""

from __future__ import annotations

import json

import pytest
from kv_transfer_helpers import GREEDY, KV, store_config

from fleetllm import LLM
from fleetllm.config import EngineConfig
from fleetllm.config_kv_transfer import KVTransferConfig
from fleetllm.errors import ConfigurationError
from fleetllm.executor.abstract import Executor
from fleetllm.kv_transfer.shared_storage import SharedStorageConnector


class CountingConnector(SharedStorageConnector):
    """A user's connector: SharedStorageConnector counting its scheduler-side lookups."""

    lookups = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        type(self).lookups += 1
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_defaults_are_vllms_and_bad_values_name_their_field(tmp_path):
    kt = KVTransferConfig.from_value(json.dumps(store_config(tmp_path)))
    assert (kt.kv_role, kt.kv_load_failure_policy) == ("kv_both", "recompute")
    assert KVTransferConfig(kv_connector="X").kv_load_failure_policy == "recompute"
    for bad, field in [({"kv_role": "kv_sideways"}, "kv_role"),
                       ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
                       ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config"),
                       ({"kv_connector_module_path": ""}, "kv_connector_module_path"),
                       ({"kv_buffer_size": 3}, "kv_buffer_size"),
                       ({"kv_connector": ""}, "kv_connector")]:
        with pytest.raises(ConfigurationError, match=field):
            KVTransferConfig.from_value({**store_config(tmp_path), **bad})
    with pytest.raises(ConfigurationError, match="not valid JSON"):
        KVTransferConfig.from_value("{kv_connector")


def test_bad_connectors_fail_before_any_worker_starts(tiny_models, tmp_path, monkeypatch):
    def no_workers(self, config):
        raise AssertionError("an executor was built")

    monkeypatch.setattr(Executor, "__init__", no_workers)
    model = tiny_models["llama_gqa"]
    cases = [({"kv_connector": "NixlConnector"}, "kv_connector"),
             ({"kv_connector": "Nope", "kv_connector_module_path": "no.such.module"},
              "kv_connector_module_path"),
             ({"kv_connector": "KVTransferConfig",
               "kv_connector_module_path": "fleetllm.config_kv_transfer"},
              "kv_connector_module_path"),
             ({"kv_connector_extra_config": {}}, "shared_storage_path"),
             ({"kv_connector_extra_config": {"shared_storage_path": str(tmp_path),
                                             "max_bytes": -1}}, "max_bytes"),
             ({"kv_connector_extra_config": {"shared_storage_path": str(tmp_path),
                                             "typo": 1}}, "typo")]
    for change, field in cases:
        with pytest.raises(ConfigurationError, match=field):
            LLM(model, kv_transfer_config={**store_config(tmp_path), **change})
    for other in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                  {"num_scheduler_steps": 4}):
        with pytest.raises(ConfigurationError, match="kv_transfer_config"):
            EngineConfig.from_kwargs(model, kv_transfer_config=store_config(tmp_path), **other)


def test_a_users_connector_class_is_imported_by_module_path_and_used(tiny_models, tmp_path):
    kt = {**store_config(tmp_path), "kv_connector": "CountingConnector",
          "kv_connector_module_path": __name__}
    CountingConnector.lookups = 0
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV,
             kv_transfer_config=KVTransferConfig.from_value(kt)) as llm:
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], GREEDY, use_tqdm=False)
        assert isinstance(llm.llm_engine.scheduler.kv_connector, CountingConnector)
    assert CountingConnector.lookups == 1


def test_the_cli_flag_reaches_the_engine_arguments(tmp_path):
    from fleetllm.cli import build_parser
    from fleetllm.engine.arg_utils import engine_kwargs_from

    text = json.dumps(store_config(tmp_path))
    for command in (["serve"], ["generate", "x"]):
        args = build_parser().parse_args([*command[:1], "--kv-transfer-config", text,
                                          *command[1:]])
        kwargs = engine_kwargs_from(args, args.engine_actions)
        assert KVTransferConfig.from_value(kwargs["kv_transfer_config"]) == \
            KVTransferConfig.from_value(store_config(tmp_path))
