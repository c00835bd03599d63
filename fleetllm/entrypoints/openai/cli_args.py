"""`fleetllm serve` flags. Kept apart from the launcher so that building the CLI parser does
not import the web stack (`fleetllm generate` stays fast)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from fleetllm import envs
from fleetllm.engine.arg_utils import add_engine_args


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="checkpoint directory (or --model; default: the bundled demo "
                             "model)")
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1: this machine only)")
    http.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    http.add_argument("--api-key", default=envs.get("FLEETLLM_API_KEY"),
                      help="require 'Authorization: Bearer KEY' (default: $FLEETLLM_API_KEY); "
                           "/health and /metrics stay open")
    http.add_argument("--served-model-name", nargs="+", default=None,
                      help="model name(s) clients use (default: the model path); the first "
                           "is the one responses and metrics report")
    http.add_argument("--chat-template", default=None,
                      help="Jinja chat template file (default: the tokenizer's)")
    http.add_argument("--shutdown-timeout", type=float, default=10.0,
                      help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    http.add_argument("--step-timeout", type=float, default=60.0,
                      help="/health reports the engine unhealthy when one step takes longer")
    http.add_argument("--allowed-origins", type=string_list, default=["*"],
                      help='CORS: origins browsers may call from, a JSON list (as vLLM) or '
                           'comma-separated (default ["*"])')
    http.add_argument("--allowed-methods", type=string_list, default=["*"],
                      help='CORS: allowed methods (default ["*"])')
    http.add_argument("--allowed-headers", type=string_list, default=["*"],
                      help='CORS: allowed request headers (default ["*"])')
    http.add_argument("--allow-credentials", action="store_true",
                      help="CORS: allow credentials (cookies, Authorization)")
    http.add_argument("--enable-request-id-headers", action="store_true",
                      help="send X-Request-Id on every response: the client's, or a fresh "
                           "one (a client's X-Request-Id names its request either way)")
    http.add_argument("--enable-sleep-mode", action="store_true",
                      help="add POST /sleep, POST /wake_up and GET /is_sleeping")
    http.add_argument("--disable-frontend-multiprocessing", action="store_true",
                      help="run the engine in the API server's process (default: an "
                           "engine-core process of its own, so HTTP never holds the GIL a "
                           "step needs)")
    http.add_argument("--max-prompts-per-request", type=int, default=4096,
                      help="the most prompts x n one completion or chat request (or "
                           "inputs one embedding request) may carry; more is a 400 before "
                           "any is tokenized (default 4096)")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='chat requests with tools may let the model choose (tool_choice '
                           '"auto", the default with tools); needs --tool-call-parser')
    http.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                      help="how tool calls are read out of a model's text for "
                           'tool_choice "auto" (vLLM\'s names)')
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument("--lora-modules", type=parse_lora_module, nargs="+", default=None,
                      metavar="NAME=PATH",
                      help="adapters served by name, loaded at start: name=path, or vLLM's "
                           'JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; a '
                           "request's model picks one")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(off: loading reads any path the server can, on a client's word)")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    http.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"])
    parser.set_defaults(engine_actions=add_engine_args(parser))
    return parser


def string_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form) or a comma-separated list."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return items
    return [x.strip() for x in value.split(",") if x.strip()]


@dataclass
class LoRAModulePath:
    """One --lora-modules entry (vLLM's)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form '{"name": ..., "path": ..., "base_model_name": ...}'
    (an argparse type: a bad one is a usage error naming it)."""
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(obj, dict) or not {"name", "path"} <= set(obj) or \
                not set(obj) <= {"name", "path", "base_model_name"} or \
                not all(isinstance(obj[k], str) for k in ("name", "path")) or \
                not isinstance(obj.get("base_model_name", ""), str | None):
            raise argparse.ArgumentTypeError(
                'the JSON form is {"name": str, "path": str, "base_model_name": str '
                f"(optional)}}, got {value[:200]}")
        module = LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name"))
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path or JSON, got "
                                             f"{value[:200]}")
        module = LoRAModulePath(name.strip(), path.strip())
    if not module.name or not module.path:
        raise argparse.ArgumentTypeError(f"an adapter needs a name and a path: "
                                         f"{value[:200]}")
    return module
