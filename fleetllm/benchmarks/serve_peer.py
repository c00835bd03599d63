"""`vllm serve` as the peer of `fleetllm bench serve --compare vllm`: vLLM's CPU build from the
peer venv (`make peers`), started on the same checkpoint with the serve flags both servers
share, its threads bound as vllm_peer binds them, on a free loopback port."""

from __future__ import annotations

import argparse
import socket

from fleetllm.benchmarks.vllm_peer import (
    VLLMConfig,
    descendants,
    remove_openmp_files,
    runner_env,
    vllm_python,
)
from fleetllm.entrypoints.openai.local_server import LocalServer

STARTUP_TIMEOUT_S = 600.0  # vLLM's first start compiles; a 2-core machine is slow at it


def vllm_serve_args(server_args: list[str]) -> list[str]:
    """The flags of a `fleetllm serve` command line that mean the same to `vllm serve`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    for flag in ("--dtype", "--max-num-seqs", "--max-model-len", "--max-num-batched-tokens",
                 "--kv-cache-dtype", "--seed"):
        parser.add_argument(flag)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    known, _ = parser.parse_known_args(server_args)
    model = known.model_tag or known.model
    if not model:
        raise SystemExit("--compare vllm needs the checkpoint directory (MODEL or --model): "
                         "vLLM cannot use fleetllm's bundled demo model's path implicitly")
    out = ["--model", model]
    for name in ("dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                 "kv_cache_dtype", "seed"):
        value = getattr(known, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", value]
    if known.enable_prefix_caching is not None:
        out.append("--enable-prefix-caching" if known.enable_prefix_caching
                   else "--no-enable-prefix-caching")
    return out


def start_vllm_server(server_args: list[str], bind: str, kv_cache_gb: int) -> LocalServer:
    python = vllm_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), *vllm_serve_args(server_args)]
    env = runner_env(VLLMConfig(False, bind), python, kv_cache_gb)
    return VLLMServer([], env=env, startup_timeout=STARTUP_TIMEOUT_S, command=command,
                      url=f"http://127.0.0.1:{port}")


class VLLMServer(LocalServer):
    """`vllm serve`, whose engine-core child leaves an OpenMP file in /dev/shm at exit."""

    def stop(self, timeout: float = 60.0) -> int | None:
        children = descendants(self.proc.pid)
        try:
            return super().stop(timeout)
        finally:
            remove_openmp_files(children)
