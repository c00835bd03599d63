"""KV transfer between instances (vLLM v1's KV connector API): see base.py and
docs/kv_transfer.md."""
