"""Stands in for `python -m vllm.entrypoints.openai.api_server` in the bench serve --compare
test (CI has no vLLM venv): records its command line, then serves with fleetllm on the port
it was given."""

import json
import os
import sys

from fleetllm.cli import main

args = sys.argv[1:]
with open(os.environ["FAKE_VLLM_ARGV"], "w") as f:
    json.dump(args, f)
host = args[args.index("--host") + 1]
port = args[args.index("--port") + 1]
model = args[args.index("--model") + 1]
rest = [a for i, a in enumerate(args)
        if a not in ("--host", "--port", "--model") and args[i - 1] not in ("--host", "--port",
                                                                          "--model")]
sys.exit(main(["serve", model, "--host", host, "--port", port, "--kv-cache-memory",
               os.environ["FAKE_VLLM_KV"], *rest]))
