"""Helpers for the server tests: a chat template, the environment a server subprocess needs,
a slow worker (so requests outlive a drain timeout), and reading Prometheus text."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleetllm.worker.worker import Worker

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
KV = 32 << 20

# The test tokenizers ship no chat template; this one is small and unambiguous.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_embed_checkpoint(path: Path, seed: int = 0, **config_json: object) -> Path:
    """A tiny random-weight embedding checkpoint: a bare `LlamaModel` (no LM head, so task
    "auto" is "embed"), the test tokenizer, and `config_json` merged into its config.json
    (e.g. matryoshka_dimensions)."""
    import torch
    import transformers
    from conftest import make_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, head_dim=16)
    config.architectures = ["LlamaModel"]
    torch.manual_seed(seed)
    model = transformers.LlamaModel(config)
    with torch.no_grad():  # as conftest's checkpoints: wide enough that vectors differ
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    if config_json:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_json}))
    make_tokenizer(path, config.vocab_size)
    return path


def stop_cleanly(srv: Any) -> None:
    """Stop a LocalServer; it must exit 0 (else its log's tail says why)."""
    code = srv.stop(timeout=30)
    assert code == 0, srv.log()[-3000:]


@contextmanager
def serving(srv: Any) -> Iterator[Any]:
    """A started LocalServer for the block's duration, stopped cleanly at its end."""
    try:
        yield srv
    finally:
        stop_cleanly(srv)


def server_env(**extra: str) -> dict[str, str]:
    """This checkout first on the path (and tests/, for worker classes defined here)."""
    path = [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


class SlowWorker(Worker):
    """Sleeps before every step, so that a request's duration is known in advance."""

    def execute_model(self, execute_model_req):
        time.sleep(float(os.environ.get("FLEETLLM_TEST_STEP_DELAY", "0.02")))
        return super().execute_model(execute_model_req)


class BatchLoggingWorker(SlowWorker):
    """A SlowWorker that appends each step's number of requests to $FLEETLLM_TEST_BATCH_LOG,
    so a test can see how the engine batched what a server sent it."""

    def execute_model(self, execute_model_req):
        log = os.environ.get("FLEETLLM_TEST_BATCH_LOG")
        if log and execute_model_req is not None:
            with open(log, "a") as f:
                f.write(f"{len(execute_model_req.seq_group_metadata_list)}\n")
        return super().execute_model(execute_model_req)


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels without model_name): value} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_core(server_pid: int) -> int:
    """The server's engine-core process (its one child that is not a resource tracker)."""
    [core] = [k for k in children_of(server_pid) if "resource_tracker" not in _cmdline(k)]
    return core


def engine_workers(server_pid: int) -> list[int]:
    """The engine's worker processes: the children of the server's engine-core process when
    it has one (the default), else the server's own (--disable-frontend-multiprocessing).
    multiprocessing's resource trackers are not workers."""
    def spawned(pid: int) -> list[int]:
        return [k for k in children_of(pid) if "resource_tracker" not in _cmdline(k)]

    kids = spawned(server_pid)
    for kid in kids:
        if spawned(kid):
            return spawned(kid)
    return kids


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class AppClient:
    """Drive an ASGI app in-process, on one event loop, through httpx's ASGI transport."""

    def __init__(self, app, headers: dict[str, str] | None = None):
        import asyncio

        import httpx

        self._runner = asyncio.Runner()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://app", headers=headers, timeout=60)

    def request(self, method: str, path: str, **kwargs):
        return self._runner.run(self.client.request(method, path, **kwargs))

    def run(self, coro):
        return self._runner.run(coro)

    def close(self) -> None:
        self._runner.run(self.client.aclose())
        self._runner.close()


def assert_error(response, status: int, param: str | None = None) -> dict:
    """An error in OpenAI's shape, small; returns its "error" object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert len(response.content) < 8192, len(response.content)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error
