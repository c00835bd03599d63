"""`fleetllm serve --kv-transfer-config`: the server's engine (in its engine-core process)
writes to the store, and a restarted server reads it back with the same answer (issue 74)."""

from __future__ import annotations

import json

import openai
from kv_transfer_helpers import block_files, store_config
from serving_helpers import KV, server_env, serving

from fleetllm.entrypoints.openai.local_server import LocalServer

PROMPT = list(range(3, 100))  # 6 whole blocks of 16 before its last token


def complete(srv: LocalServer) -> list[str]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                    logprobs=1)
    return out.choices[0].logprobs.tokens


def test_a_restarted_server_reads_the_store(tiny_models, tmp_path):
    args = [str(tiny_models["llama_gqa"]), "--kv-cache-memory", str(KV),
            "--served-model-name", "m", "--kv-transfer-config",
            json.dumps(store_config(tmp_path))]
    with serving(LocalServer(args, env=server_env())) as srv:
        first = complete(srv)
    written = block_files(tmp_path)
    assert len(written) == len(PROMPT) // 16
    mtimes = [p.stat().st_mtime_ns for p in written]
    with serving(LocalServer(args, env=server_env())) as srv:
        assert complete(srv) == first
    assert block_files(tmp_path) == written  # nothing written again
    assert [p.stat().st_mtime_ns for p in written][:5] != mtimes[:5]  # read: touched (LRU)
