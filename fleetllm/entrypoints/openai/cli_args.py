"""`fleetllm serve` flags. Kept apart from the launcher so that building the CLI parser does
not import the web stack (`fleetllm generate` stays fast)."""

from __future__ import annotations

import argparse
import os


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from fleetllm.cli import add_engine_args

    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="checkpoint directory (or --model; default: the bundled demo "
                             "model)")
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1: this machine only)")
    http.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    http.add_argument("--api-key", default=os.environ.get("FLEETLLM_API_KEY"),
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
    http.add_argument("--enable-sleep-mode", action="store_true",
                      help="add POST /sleep, POST /wake_up and GET /is_sleeping")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    http.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"])
    parser.set_defaults(engine_actions=add_engine_args(parser))
    return parser
