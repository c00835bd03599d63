"""`fleetllm bench serve --offline-replay`: the replay loop admits requests when the client
sent them (and under --max-concurrency as the client's gate does) and times tokens as the
client does; an engine made from serve flags is the engine the server would make."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from fleetllm.benchmarks import serve, serve_figures, serve_replay


@dataclass
class _Completion:
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool
    error: str | None = None


class FakeEngine:
    """Each step gives every running request one token; records when requests came in."""

    def __init__(self, step_s: float = 0.01):
        self.step_s, self.running, self.added, self.widest = step_s, {}, {}, 0

    def add_request(self, rid, prompt, params):
        assert prompt == {"prompt_token_ids": [1, 2, 3]} and params.ignore_eos
        self.added[rid] = time.perf_counter()
        self.running[rid] = (params.max_tokens, [])

    def step(self):
        time.sleep(self.step_s)
        self.widest = max(self.widest, len(self.running))
        outs = []
        for rid, (limit, tokens) in list(self.running.items()):
            tokens.append(7)
            done = len(tokens) == limit
            outs.append(_Output(rid, [_Completion(list(tokens), "length" if done else None)],
                                done))
            if done:
                del self.running[rid]
        return outs


def test_requests_arrive_when_the_client_sent_them_and_tokens_are_timed_per_step():
    engine = FakeEngine()
    arrivals = [0.0, 0.02, 0.5]
    start = time.perf_counter()
    results = [serve.RequestResult() for _ in arrivals]
    duration = serve_replay._loop(engine, [([1, 2, 3], 4)] * 3, arrivals, 0.0, None, results)
    for i, at in enumerate(arrivals):  # never early; late by at most the step under way
        assert at <= engine.added[str(i)] - start < at + 0.2
    assert all(r.ok and r.output_tokens == 4 and len(r.itls) == 3 for r in results)
    for r in results:  # clock from the arrival: the step under way (if any), then one step
        assert 0.01 <= r.ttft < 0.2
        assert r.e2e == pytest.approx(r.ttft + sum(r.itls))
    assert duration >= 0.5 + 4 * 0.01
    assert engine.widest == 2  # the third came after the first two had finished


def test_max_concurrency_holds_requests_back_as_the_clients_gate_does():
    engine = FakeEngine()
    results = [serve.RequestResult() for _ in range(6)]
    duration = serve_replay._loop(engine, [([1, 2, 3], 3)] * 6, [0.0] * 6, 0.0, 2, results)
    assert engine.widest == 2 and all(r.ok for r in results)
    assert duration >= 9 * 0.01  # three rounds of two, three steps each
    # A held-back request's clock starts when the gate lets it through, as the client's does:
    # its first token comes one step later, sooner than the first pair's last (clocked from
    # the arrival, the last pair's would come six steps after that).
    assert all(r.ttft < results[0].e2e for r in results), [r.ttft for r in results]
    summary = serve_figures.summarize(results, 1.0, serve.build_parser().parse_args([]))
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 18


def test_the_replay_engine_gets_the_servers_engine_flags():
    model, kwargs = serve_replay.engine_args(
        ["/ckpt", "--max-num-seqs", "8", "--dtype", "float32", "--served-model-name", "m",
         "--no-enable-prefix-caching", "--disable-frontend-multiprocessing"])
    assert model == "/ckpt"
    assert kwargs == {"max_num_seqs": 8, "dtype": "float32", "enable_prefix_caching": False}


@pytest.mark.parametrize("extra", [["--base-url", "http://127.0.0.1:1"],
                                   ["--endpoint", "/v1/chat/completions"],
                                   ["--structured-fraction", "0.5"]])
def test_what_cannot_be_replayed_is_refused_before_anything_starts(extra, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--offline-replay", *extra])
    assert "--offline-replay" in capsys.readouterr().err


def _figures(tpot_ms: float, replay_ms: float) -> dict:
    overhead = {"tpot": tpot_ms / replay_ms - 1, "itl": 0.0, "ttft": 0.0}
    return {"mean_tpot_ms": tpot_ms, "offline_replay": {"mean_tpot_ms": replay_ms},
            "serving_overhead": overhead}


def test_repeat_runs_whole_rounds_in_turn_and_reports_the_median_overhead(monkeypatch,
                                                                           tmp_path):
    # Each round: a fresh server (base_url None again), the first round's prompts reused.
    calls, figures = [], [_figures(13.0, 10.0), _figures(10.5, 10.0), _figures(11.0, 10.0)]

    def fake_round(args, server_args, prompts):
        calls.append((args.base_url, prompts, server_args))
        args.base_url = "http://127.0.0.1:1"  # what starting a server sets
        return figures[len(calls) - 1], ["the prompts"]

    monkeypatch.setattr(serve, "_round", fake_round)
    out = serve.main(["--offline-replay", "--repeat", "3", "--quiet", "/ckpt",
                      "--json", str(tmp_path / "r.json")])
    assert calls == [(None, None, ["/ckpt"]), (None, ["the prompts"], ["/ckpt"]),
                     (None, ["the prompts"], ["/ckpt"])]
    assert out["rounds"] == figures
    assert out["serving_overhead"]["tpot"] == pytest.approx(0.1)  # not the mean (0.15)
    assert "ratios" not in out
    assert (tmp_path / "r.json").exists()


def test_medians_of_compare_ratios_and_printed_rounds(capsys):
    rounds = [{"fleetllm": _figures(tpot, 10.0),
               "ratios": {key: r for key, _ in serve_figures.RATIOS}}
              for tpot, r in ((12.0, 0.9), (11.0, 1.2), (10.2, 0.95))]
    out = serve_replay.medians(rounds)
    assert out["ratios"] == {key: 0.95 for key, _ in serve_figures.RATIOS}
    assert out["serving_overhead"]["tpot"] == pytest.approx(0.1)
    printed = capsys.readouterr().out
    assert "median of the rounds" in printed and "+20.0%" in printed and "+2.0%" in printed


def test_repeat_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--repeat", "0", "/ckpt"])
    assert "--repeat" in capsys.readouterr().err


def test_server_flags_beside_base_url_are_refused(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--base-url", "http://127.0.0.1:1", "--dtype", "float32"])
    assert "unrecognized arguments: --dtype float32" in capsys.readouterr().err
