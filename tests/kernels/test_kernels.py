"""The torch.ops.fleetllm ops and their build: schemas and argument checks, out-of-memory as an
error, fork safety, every instruction-set variant and both thread modes agreeing, and the
pure-PyTorch fallback when no compiler is there."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_cases import decoder_layer_args, flat, op_outputs

from fleetllm.kernels import build as kernel_build
from fleetllm.kernels import cpu_kernels
from fleetllm.kernels.cpu_kernels import LinearKind

REPO = Path(__file__).resolve().parents[2]
SANITIZE = os.environ.get("FLEETLLM_KERNEL_SANITIZE", "0") != "0"
# Runs in other processes that build other libraries: not what the sanitizer run checks.
not_under_sanitizer = pytest.mark.skipif(SANITIZE, reason="builds other variants")
# Builds and runs a tool of its own with the normal flags: nothing of the sanitized library.
tool_not_under_sanitizer = pytest.mark.skipif(SANITIZE, reason="builds a tool of its own")

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")


def python(code: str, env: dict[str, str] | None = None, timeout: float = 300
           ) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
            **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


@needs_kernels
def test_ops_have_schemas():
    schemas = {n: str(getattr(torch.ops.fleetllm, n).default._schema)
               for n in ("gemv", "paged_decode", "prefill_attention", "rope_qk_kv",
                         "decoder_layer", "decoder_layers", "greedy_passes", "argmax")}
    assert schemas["gemv"] == "fleetllm::gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
    assert "Tensor(a!) out) -> ()" in schemas["paged_decode"]
    assert "Tensor(a!) out) -> ()" in schemas["prefill_attention"]
    assert "Tensor(a!)? kv_cache, Tensor? slots) -> (Tensor, Tensor)" in schemas["rope_qk_kv"]
    assert "Tensor(b!) kv_cache" in schemas["decoder_layer"]
    assert "Tensor(b!)[] kv_caches" in schemas["decoder_layers"]
    assert "Tensor(a!)[] kv_caches" in schemas["greedy_passes"]
    assert schemas["argmax"] == "fleetllm::argmax(Tensor x) -> Tensor"
    assert kernel_build.best_variant() in kernel_build.variants()
    assert ("sanitize: address,undefined" in cpu_kernels.build_info()) == SANITIZE


def _decode_args(**changes):
    g = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(2, 4, 16, generator=g), kv_cache=torch.randn(2, 8, 4, 2, 16),
                tables=torch.tensor([0, 1, 2], dtype=torch.int32),
                table_start=torch.tensor([0, 1], dtype=torch.int32),
                ctx_lens=torch.tensor([3, 8], dtype=torch.int32), window=0, scale=0.25,
                out=torch.empty(2, 4, 16))
    args.update(changes)
    return args


@needs_kernels
@pytest.mark.parametrize("changes, message", [
    (dict(q=torch.randn(2, 4, 16, dtype=torch.float64)), "q must be float32"),
    (dict(q=torch.randn(2, 16, 4).transpose(1, 2)), "heads and dims must be contiguous"),
    (dict(q=torch.randn(2, 3, 16)), "does not match kv_cache"),
    (dict(out=torch.empty(2, 4, 8)), "out must have shape"),
    (dict(kv_cache=torch.randn(8, 4, 2, 16)), "kv_cache must have 5 dimensions"),
    (dict(tables=torch.tensor([0, 1, 2])), "tables must be Int"),
    (dict(tables=torch.tensor([0, 1, 9], dtype=torch.int32)), "names block 9 of 8"),
    (dict(ctx_lens=torch.tensor([3, 9], dtype=torch.int32)), "exceed the 3 table entries"),
    (dict(ctx_lens=torch.tensor([3], dtype=torch.int32)), "ctx_lens must have 2 entries"),
    (dict(table_start=torch.tensor([0, -1], dtype=torch.int32)), "from table entry -1"),
    (dict(window=-1), "window out of range"),
])
def test_paged_decode_checks_its_arguments(changes, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fleetllm.paged_decode(**_decode_args(**changes))
    torch.ops.fleetllm.paged_decode(**_decode_args())  # the unchanged call is fine


@needs_kernels
def test_other_ops_check_their_arguments():
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    cases = [
        (lambda: cpu_kernels.gemv(x, w[:, :4], None), "weight must have shape \\[5, 8\\]"),
        (lambda: cpu_kernels.gemv(x, w, torch.randn(4)), "bias must have shape"),
        (lambda: cpu_kernels.gemv(x.t(), w.t(), None), "must be contiguous"),
        (lambda: cpu_kernels.add_rmsnorm(x, torch.randn(3, 8), x[0], 1e-6), "residual"),
        (lambda: cpu_kernels.silu_mul(torch.randn(2, 7)), "gate_up must be"),
        (lambda: cpu_kernels.rope_qk_kv(torch.randn(3, 64), torch.randn(3, 1, 8),
                                        torch.randn(3, 1, 8), 2, 1, torch.randn(2, 4, 4, 1, 16),
                                        torch.tensor([0, 1, 16])), "slot 16 of token 2"),
        (lambda: cpu_kernels.rope_qk_kv(torch.randn(3, 64), torch.randn(2, 1, 8),
                                        torch.randn(3, 1, 8), 2, 1, None, None), "cos and sin"),
        (lambda: torch.ops.fleetllm.gemv(x, 3, None), "Expected a value of type 'Tensor'"),
    ]
    g, rope = torch.Generator().manual_seed(0), torch.randn(3, 1, 8)
    args = decoder_layer_args(g, rope, rope)
    short_w_o, bad_b_o = list(args["weights"]), list(args["weights"])
    short_w_o[5] = short_w_o[5][:, :-1].contiguous()  # one input column short
    bad_b_o[6] = torch.randn(7)
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "weights": tuple(short_w_o)}),
                  "w_o must have shape"))
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "weights": tuple(bad_b_o)}),
                  "b_o must have shape"))
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "heads": 6}), "w_qkv must have"))
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "cos": rope[:2]}), "cos and sin"))
    # the kind names the packed copies' layout: a copy of another layout, or none, is refused
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "kind": LinearKind.PAIRS}),
                  "kind 3 needs 4 packed weights"))
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "kind": 9}),
                  "9 is not a LinearKind"))
    dense4 = tuple(args["weights"][i] for i in (3, 5, 7, 9))
    cases.append((lambda: cpu_kernels.decoder_layer(**{**args, "packed": dense4,
                                                       "kind": LinearKind.ONEDNN}),
                  "must be oneDNN's"))
    cases += [(lambda: cpu_kernels.argmax(x[0]), "x must have 2 dimensions"),
              (lambda: cpu_kernels.argmax(x[:, :0]), "rows of no elements"),
              (lambda: cpu_kernels.argmax(w.t()), "rows must be contiguous"),
              (lambda: cpu_kernels.argmax(x.double()), "x must be float32 or bfloat16")]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    cpu_kernels.decoder_layer(**args)  # the unchanged call is fine


@needs_kernels
def test_decoder_layers_are_decoder_layer_in_turn():
    """decoder_layers (a decode step's layers in one call: model/fused.py) gives bit for bit
    what decoder_layer gives layer after layer: the output, the residual and every layer's
    cache, with the first layer setting the residual or a later pipeline stage's coming in;
    and it refuses lists that do not match its layers."""
    g = torch.Generator().manual_seed(3)
    rope = (torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g))
    base = decoder_layer_args(g, *rope)
    weights = [decoder_layer_args(g, *rope)["weights"] for _ in range(3)]
    caches = [torch.randn(base["kv_cache"].shape, generator=g) for _ in range(3)]
    windows = [0, 2, 0]
    listed = [t for w in weights for t in (*w[:2], *w[3:])]
    step = [base[k] for k in ("slots", "tables", "table_start", "ctx_lens")]

    def layers(residual, first, kv_caches, given=listed, windows=windows):
        return cpu_kernels.decoder_layers(base["x"], residual, first, given, 1e-6, base["heads"],
                                          windows, base["scale"], *rope, kv_caches, *step, [],
                                          positions=torch.arange(3))

    for first in (True, False):
        residual = torch.randn(base["x"].shape, generator=g)
        want_res, want_caches, h = residual.clone(), [c.clone() for c in caches], base["x"]
        for i, w in enumerate(weights):
            h = cpu_kernels.decoder_layer(h, want_res, first and i == 0, w, base["heads"],
                                          windows[i], base["scale"], *rope, want_caches[i],
                                          *step)
        got_caches = [c.clone() for c in caches]
        out = layers(residual, first, got_caches)
        assert torch.equal(out, h) and torch.equal(residual, want_res)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True))
    none_weight = list(listed)
    none_weight[11] = None  # layer 1's w_post
    for call, message in [
            (lambda: layers(torch.empty(3, 32), True, caches, windows=windows[:2]), "3 caches"),
            (lambda: layers(torch.empty(3, 32), True, caches, given=listed[:-1]), "3 caches"),
            (lambda: layers(torch.empty(3, 32), True, caches, given=none_weight),
             "layer 1's weight 1 is None")]:
        with pytest.raises(RuntimeError, match=message):
            call()


@needs_kernels
def test_decoder_layers_embed_the_ids_and_apply_the_final_norm():
    """Given the embedding, decoder_layers takes the step's token ids and looks their rows up;
    given the final norm, it returns add_rmsnorm(output, residual): bit for bit what the
    lookup, the layers and the norm give as separate calls (the fused step's first and last
    Python calls, model/fused.py). An id outside the vocabulary is refused, not read."""
    g = torch.Generator().manual_seed(5)
    rope = (torch.randn(3, 1, 8, generator=g), torch.randn(3, 1, 8, generator=g))
    base = decoder_layer_args(g, *rope)
    weights = [decoder_layer_args(g, *rope)["weights"] for _ in range(2)]
    listed = [t for w in weights for t in (*w[:2], *w[3:])]
    step = [base[k] for k in ("slots", "tables", "table_start", "ctx_lens")]
    table, norm = torch.randn(11, 32, generator=g), torch.randn(32, generator=g)
    ids = torch.tensor([3, 0, 10])

    def layers(x, residual, caches, **kw):
        return cpu_kernels.decoder_layers(x, residual, True, listed, 1e-6, base["heads"], [0, 0],
                                          base["scale"], *rope, caches, *step, [],
                                          positions=torch.arange(3), **kw)

    caches = [torch.randn(base["kv_cache"].shape, generator=g) for _ in range(2)]
    want_caches, want_res = [c.clone() for c in caches], torch.empty(3, 32)
    out = layers(table.index_select(0, ids), want_res, want_caches)
    want = cpu_kernels.add_rmsnorm(out, want_res, norm, 1e-6)
    got_res = torch.empty(3, 32)
    got = layers(ids, got_res, caches, embed=table, final_norm=norm)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches, strict=True))
    for bad in (11, -1):
        with pytest.raises(RuntimeError, match=f"token id {bad} is outside the vocabulary"):
            layers(torch.tensor([3, bad, 0]), torch.empty(3, 32), caches, embed=table)


@needs_kernels
def test_decoder_layers_look_up_the_rope_rows_of_the_positions():
    """decoder_layers takes RoPE's whole tables and looks the rows of the step's positions up
    itself (model/fused.py: two index_selects fewer a step): bit for bit decoder_layer given
    the rows, layer after layer, caches included; a position outside the tables is refused,
    not read."""
    g = torch.Generator().manual_seed(9)
    full = (torch.randn(40, 1, 8, generator=g), torch.randn(40, 1, 8, generator=g))
    positions = torch.tensor([17, 0, 39])
    rows = tuple(t.index_select(0, positions) for t in full)
    base = decoder_layer_args(g, *rows)
    weights = [decoder_layer_args(g, *rows)["weights"] for _ in range(2)]
    listed = [t for w in weights for t in (*w[:2], *w[3:])]
    step = [base[k] for k in ("slots", "tables", "table_start", "ctx_lens")]
    caches = [torch.randn(base["kv_cache"].shape, generator=g) for _ in range(2)]

    def layers(residual, kv_caches, positions):
        return cpu_kernels.decoder_layers(base["x"], residual, True, listed, 1e-6,
                                          base["heads"], [0, 0], base["scale"], *full,
                                          kv_caches, *step, [], positions=positions)

    want_caches, want_res, want = [c.clone() for c in caches], torch.empty(3, 32), base["x"]
    for i, w in enumerate(weights):
        want = cpu_kernels.decoder_layer(want, want_res, i == 0, w, base["heads"], 0,
                                         base["scale"], *rows, want_caches[i], *step)
    got_res = torch.empty(3, 32)
    got = layers(got_res, caches, positions)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches, strict=True))
    for bad in (40, -1):
        with pytest.raises(RuntimeError, match=f"position {bad} is outside the RoPE tables"):
            layers(torch.empty(3, 32), caches, torch.tensor([3, bad, 0]))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_passes_are_the_layers_head_and_argmax_in_turn(dtype):
    """greedy_passes (multi-step decoding's passes in one call: worker/greedy_passes.py) gives
    bit for bit what decoder_layers (embedding, final norm), the GEMV of the LM head and the
    argmax give pass after pass, each pass's tokens the next one's ids: the tokens and every
    layer's cache. A changed interrupt count ends it after the pass under way, and so does
    the pass after which every row has drawn one of its stop tokens; arguments that do not
    match are refused."""
    g = torch.Generator().manual_seed(11)
    full = (torch.randn(40, 1, 8, generator=g).to(dtype),
            torch.randn(40, 1, 8, generator=g).to(dtype))
    base = decoder_layer_args(g, *full)
    weights = [tuple(w.to(dtype) if isinstance(w, torch.Tensor) else w
                     for w in decoder_layer_args(g, *full)["weights"]) for _ in range(2)]
    listed = [t for w in weights for t in (*w[:2], *w[3:])]
    embed, norm = torch.randn(11, 32, generator=g).to(dtype), torch.randn(32).to(dtype)
    head = torch.randn(11, 32, generator=g).to(dtype)
    k, bs = 4, 16
    cache = torch.randn(2, 8, bs, 2, 16, generator=g).to(dtype)
    tables = [[3, 5], [0, 7], [6, 1]]
    ctx0 = [5, 14, 20]  # each row's context before the first pass, its last token included
    pos = torch.tensor([[c - 1 + i for c in ctx0] for i in range(k)])
    slots = torch.tensor([[tables[r][p // bs] * bs + p % bs for r, p in enumerate(row)]
                          for row in pos.tolist()])
    ctx = (pos + 1).to(torch.int32)
    flat_tables = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
    starts = torch.tensor([0, 2, 4], dtype=torch.int32)
    ids = torch.tensor([3, 0, 10])

    def passes(caches, interrupts=None, **changes):
        args = dict(positions=pos, embed=embed, final_norm=norm, head=head, head_n=11,
                    head_kind=LinearKind.GEMV, stops=torch.empty(3, 0, dtype=torch.long),
                    interrupts=torch.zeros(1, dtype=torch.long)
                    if interrupts is None else interrupts, interrupts_before=0)
        args.update(changes)
        return cpu_kernels.greedy_passes(ids, listed, 1e-6, base["heads"], [0, 0],
                                         base["scale"], *full, caches, slots, flat_tables,
                                         starts, ctx, [], LinearKind.GEMV, **args)

    want_caches, x, want = [cache.clone(), cache.clone()], ids, []
    for i in range(k):
        h = cpu_kernels.decoder_layers(x, torch.empty(3, 32, dtype=dtype), True, listed, 1e-6,
                                       base["heads"], [0, 0], base["scale"], *full,
                                       want_caches, slots[i], flat_tables, starts, ctx[i], [],
                                       positions=pos[i], embed=embed, final_norm=norm)
        x = cpu_kernels.argmax(cpu_kernels.gemv(h, head, None))
        want.append(x)
    got_caches = [cache.clone(), cache.clone()]
    got = passes(got_caches)
    assert torch.equal(got, torch.stack(want))
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True))
    stopped = passes([cache.clone(), cache.clone()], torch.ones(1, dtype=torch.long))
    assert torch.equal(stopped, got[:1])  # the count moved: one pass, then the call ends
    # Each row's stop tokens: row 0 stops at the token it draws in pass 2, row 1 at pass 0's,
    # row 2 at pass 1's (plus a token it never draws, and padding): the call ends after the
    # first pass by which all three have stopped.
    drawn = got.t().tolist()
    ends = [2, 0, 1]
    stops = torch.tensor([[drawn[0][2], -1], [drawn[1][0], -1], [drawn[2][1], 99]])
    want_passes = max(row.index(row[e]) for row, e in zip(drawn, ends, strict=True)) + 1
    ended = passes([cache.clone(), cache.clone()], stops=stops)
    assert torch.equal(ended, got[:want_passes]) and want_passes <= 3
    for changes, message in [
            (dict(positions=pos[:3]), "slots must be a contiguous CPU Long \\[3, 3\\], got "
                                      "\\[4, 3\\]"),
            (dict(head_kind=7), "head_kind: 7 is not a LinearKind"),
            (dict(interrupts=torch.zeros(1)), "interrupts must be one aligned CPU int64"),
            (dict(stops=torch.zeros(2, 1, dtype=torch.long)), "stops must be a contiguous CPU "
                                                               "Long \\[3, S\\]")]:
        with pytest.raises(RuntimeError, match=message):
            passes([cache.clone(), cache.clone()], **changes)


@needs_kernels
def test_argmax_gives_torchs_indices():
    """The first of equal maxima, the first NaN of a row with one, -inf rows, strided rows,
    rows shorter than a vector and longer, split across threads or not."""
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        rows, n = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 300, (1,),
                                                                                 generator=g))
        x = torch.randint(-3, 4, (rows, n + 7), generator=g).float()[:, 7 * (trial % 2):][:, :n]
        u = torch.rand(rows, n, generator=g)
        x[u < 0.05], x[u > 0.99] = float("-inf"), float("inf")
        if trial % 5 == 0:
            x[u < 0.01] = float("nan")
        if trial % 9 == 0:
            x[0] = float("-inf")
        for t in (x, x.bfloat16()):
            assert torch.equal(cpu_kernels.argmax(t), t.argmax(dim=-1)), (trial, t)
    big = torch.randn(300, 32000, generator=g)  # a vocabulary, rows over the threads
    big[7, 31999] = big[7].max() + 1
    assert torch.equal(cpu_kernels.argmax(big), big.argmax(dim=-1))
    assert cpu_kernels.argmax(torch.empty(0, 5)).shape == (0,)


@needs_kernels
@pytest.mark.skipif(SANITIZE, reason="ASan reserves terabytes of address space")
def test_out_of_memory_is_an_error_not_a_crash():
    """paged_decode and decoder_layer used to malloc their scratch unchecked: a failed
    allocation was a segfault, which under `uni` kills the user's process. Their scratch is now
    a torch tensor: here ~150 GB, beyond this process's address-space limit, and torch's
    allocator error is what errors.as_out_of_memory classifies as OutOfMemoryError."""
    proc = python("""
        import resource, torch
        from fleetllm.kernels import cpu_kernels
        from fleetllm.errors import OutOfMemoryError, as_out_of_memory
        assert cpu_kernels.available()
        torch.set_num_threads(2)
        h, kvh, d, bs = 1024, 1, 4, 1 << 20   # 16 blocks of 1M tokens: all of them block 0
        cache = torch.zeros(2, 1, bs, kvh, d)
        tables = torch.zeros(16, dtype=torch.int32)
        start, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([16 << 20], dtype=torch.int32)
        q = torch.zeros(1, h, d)
        hid, inter = 8, 8
        weights = (torch.ones(hid), torch.ones(hid), 1e-6, torch.zeros((h + 2) * d, hid), None,
                   torch.zeros(hid, h * d), None, torch.zeros(2 * inter, hid), None,
                   torch.zeros(hid, inter), None)
        rope = torch.zeros(1, 1, d // 2)
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), resource.RLIM_INFINITY))
        calls = {
            "paged_decode": lambda: cpu_kernels.paged_decode(
                q, cache, tables, start, lens, 0, 0.5, torch.empty_like(q)),
            "decoder_layer": lambda: cpu_kernels.decoder_layer(
                torch.zeros(1, hid), torch.zeros(1, hid), False, weights, h, 0, 0.5, rope,
                rope, cache, torch.zeros(1, dtype=torch.long), tables, start, lens),
        }
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                assert isinstance(as_out_of_memory(e), OutOfMemoryError), e
                print(name, "OOM:", str(e).splitlines()[0])
        """)
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["paged_decode OOM", "decoder_layer OOM"]
    assert all("DefaultCPUAllocator: can't allocate memory" in line for line in lines), lines


@needs_kernels
def test_a_forked_child_can_use_the_kernels():
    """Fork while another thread runs kernels on the pool, then run kernels in the child: the
    pool must not wait in the child for the parent's locks or workers (pthread_atfork)."""
    proc = python("""
        import os, random, threading, time, torch
        from fleetllm.kernels import cpu_kernels as ck
        assert ck.available()
        torch.set_num_threads(2)
        x, w = torch.randn(4, 512), torch.randn(2048, 512)   # large enough for the pool
        want = ck.gemv(x, w, None)
        stop = threading.Event()
        def busy():
            while not stop.is_set():
                ck.gemv(x[:1], w, None)
                time.sleep(random.random() * 1e-4)
        thread = threading.Thread(target=busy)
        thread.start()
        hung = failed = 0
        for i in range(40):
            time.sleep(random.random() * 2e-3)
            pid = os.fork()
            if pid == 0:
                ok = all(torch.equal(ck.gemv(x, w, None), want) for _ in range(5))
                os._exit(0 if ok else 1)
            deadline = time.monotonic() + 20
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(1e-3)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
            elif done[1] != 0:
                failed += 1
        stop.set()
        thread.join()
        print("hung", hung, "failed", failed)
        """)
    assert proc.stdout.strip() == "hung 0 failed 0"


def _compare(other: dict, tol: float = 0.0) -> None:
    ours = op_outputs()
    assert other.keys() - {"build_info"} == ours.keys()
    for name, value in ours.items():
        for a, b in zip(flat(value), flat(other[name]), strict=True):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=name)


def _outputs_from(tmp_path: Path, env: dict[str, str]) -> dict:
    out = tmp_path / "outputs.pt"
    python(f"import runpy, sys; sys.argv = ['', {str(out)!r}]; "
           f"runpy.run_path({str(REPO / 'tests' / 'kernel_cases.py')!r}, run_name='__main__')",
           env=env)
    return torch.load(out)


@needs_kernels
@not_under_sanitizer
def test_torch_threads_give_identical_results(tmp_path):
    """FLEETLLM_KERNEL_THREADS=torch runs the same work items on at::parallel_for: every item
    is computed by one thread either way, so the outputs are bitwise equal."""
    other = _outputs_from(tmp_path, {"FLEETLLM_KERNEL_THREADS": "torch"})
    assert other["build_info"].endswith("threads: torch")
    _compare(other)


_BF16_CASES = """
import random, sys, torch
from fleetllm.kernels import cpu_kernels
assert cpu_kernels.available(), "the kernels did not load"
rng, outs = random.Random(7), []
for case in range(40):  # odd lengths, blocks of 1-32, windows, 1-8 query heads per KV head
    bs, d = rng.choice([1, 4, 16, 32]), rng.choice([64, 128])
    kvh, group, batch = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 5, 8]), rng.choice([1, 3, 9])
    lens = [rng.randint(1, 1100) for _ in range(batch)]  # past a 512-key chunk, too
    per = [-(-n // bs) for n in lens]
    g = torch.Generator().manual_seed(case)
    cache = torch.randn(2, sum(per) + 2, bs, kvh, d, generator=g).bfloat16()
    tables = torch.randperm(sum(per) + 2, generator=g)[:sum(per)].int()
    starts = torch.tensor([sum(per[:i]) for i in range(batch)], dtype=torch.int32)
    q = (torch.randn(batch, kvh * group, d, generator=g) * 2).bfloat16()
    out = torch.empty_like(q)
    cpu_kernels.paged_decode(q, cache, tables, starts, torch.tensor(lens, dtype=torch.int32),
                             rng.choice([0, 0, 100]), d ** -0.5, out)
    outs.append(out)
prefill = []
for case in range(40):  # prompts after a cached prefix or not, past a 512-key chunk, windows
    bs, d = rng.choice([1, 4, 16, 32]), rng.choice([64, 128])
    kvh, group, n = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 5, 7, 8]), rng.choice([1, 2, 5])
    qlens = [rng.randint(1, 300) for _ in range(n)]
    ctxs = [m + rng.choice([0, 0, rng.randint(1, 700)]) for m in qlens]
    blocks = -(-sum(ctxs) // bs) + 4
    g = torch.Generator().manual_seed(100 + case)
    cache = torch.randn(2, blocks, bs, kvh, d, generator=g).bfloat16()
    slots = torch.randperm(blocks * bs, generator=g)[:sum(ctxs)]
    q = (torch.randn(sum(qlens), kvh * group, d, generator=g) * 2).bfloat16()
    spans = torch.tensor([(sum(qlens[:i]), qlens[i], ctxs[i], sum(ctxs[:i])) for i in range(n)],
                         dtype=torch.int32)
    out = torch.empty_like(q)
    cpu_kernels.prefill_attention(q, cache, spans, slots, rng.choice([None, None, 100]),
                                  d ** -0.5, out)
    prefill.append(out)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(5, 1000, generator=g).bfloat16(), torch.randn(300, 1000, generator=g).bfloat16()
torch.save({"decode": outs, "prefill": prefill,
            "gemv": [cpu_kernels.gemv(x[:m], w, None) for m in (1, 3, 5)],
            "build_info": cpu_kernels.build_info()}, sys.argv[1])
"""


@needs_kernels
@not_under_sanitizer
def test_bf16_dot_products_and_the_loops_they_replace_agree(tmp_path):
    """Where the CPU has AVX-512 BF16, the avx512 variant multiplies bf16 pairs with vdpbf16ps:
    the GEMV's bf16 tile, a bf16 model's decode attention P . V (two positions per
    instruction) and its prompt attention q . K and P . V. The loops they replace run on
    AVX-512 CPUs without it (Ice Lake), here with FLEETLLM_CPU_BF16_DOT=0: attention gives the
    same bits either way (the pairs are summed in the loops' order), the GEMV the same values
    to bf16 rounding. (AMX off in both: on the tiles prompt attention sums in their order, see
    the next test; vdpbf16ps asked for, FLEETLLM_CPU_BF16_PAIRS=dot, where it is slow and prompt
    attention would take the loops.)"""
    runs = {flag: _bf16_outputs(tmp_path, f"dot{flag}", {"FLEETLLM_CPU_BF16_DOT": flag,
                                                         "FLEETLLM_CPU_AMX": "0",
                                                         "FLEETLLM_CPU_BF16_PAIRS": "dot"})
            for flag in ("1", "0")}
    assert "avx512bf16" not in runs["0"]["build_info"]
    if "avx512bf16" not in runs["1"]["build_info"]:
        pytest.skip("this CPU has no AVX-512 BF16: both runs took the same loops")
    for a, b in zip(runs["1"]["decode"], runs["0"]["decode"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs["1"]["prefill"], runs["0"]["prefill"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs["1"]["gemv"], runs["0"]["gemv"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-2)


def _bf16_outputs(tmp_path: Path, name: str, env: dict[str, str]) -> dict:
    """_BF16_CASES' outputs from a process with `env` (as _outputs_from for kernel_cases.py)."""
    out = tmp_path / f"{name}.pt"
    python(f"import sys; sys.argv = ['', {str(out)!r}]; exec({_BF16_CASES!r})", env=env)
    return torch.load(out)


@needs_kernels
@not_under_sanitizer
def test_bf16_prompt_attention_on_amx_tiles_agrees_with_the_pairs(tmp_path):
    """Where the CPU has AMX, a bf16 model's prompt attention runs q . K and P . V on the tiles
    (attention_amx.h), which sum a tile's products in an order of their own: on the 40 random
    cases (prefixes, windows, 512-key chunks, 1-8 query heads per KV head, D 64 and 128) the
    outputs are the pairs kernel's to bf16 rounding and not all bit-equal (the tiles ran);
    decode attention and the GEMV do not use them (bit-equal)."""
    if not cpu_kernels.amx_available():
        pytest.skip("this CPU (or its OS) gives no AMX")
    amx = _bf16_outputs(tmp_path, "amx", {"FLEETLLM_CPU_BF16_DOT": "1"})
    pairs = _bf16_outputs(tmp_path, "pairs",
                          {"FLEETLLM_CPU_BF16_DOT": "1", "FLEETLLM_CPU_AMX": "0"})
    for a, b in zip(amx["decode"], pairs["decode"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(amx["gemv"], pairs["gemv"], strict=True):
        assert torch.equal(a, b)
    differ = 0
    for a, b in zip(amx["prefill"], pairs["prefill"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2e-2)
        differ += int((a != b).sum())
    assert differ > 0, "the prompt attention gave the pairs' bits: the tiles did not run"


@needs_kernels
@not_under_sanitizer
@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_other_instruction_set_variants_agree(variant, tmp_path):
    """What a wheel built here runs on another x86 CPU: the lower variants, built and loaded
    for real (FLEETLLM_CPU_ISA), agree with this CPU's to fp32 rounding. Built with -Werror
    (FLEETLLM_KERNEL_WERROR): the build is then also the variant's compile check, which
    test_every_variant_compiles_without_warnings does not repeat."""
    best = kernel_build.best_variant()
    if variant not in kernel_build.variants() or variant == best:
        pytest.skip(f"{variant} is this machine's own variant, or not an option here")
    if kernel_build._RANK[variant] > kernel_build._RANK[best]:
        pytest.skip(f"this CPU cannot run {variant}")
    other = _outputs_from(tmp_path, {"FLEETLLM_CPU_ISA": variant, "FLEETLLM_KERNEL_WERROR": "1"})
    assert ("avx2" in other["build_info"]) == (variant == "avx2"), other["build_info"]
    assert "avx512f" not in other["build_info"]
    _compare(other, tol=2e-5)


@needs_kernels
@not_under_sanitizer
def test_every_variant_compiles_without_warnings():
    """-Wall -Wextra -Werror for every variant of this machine's architecture, whether or not
    this CPU runs it (the CI's compile check): a syntax-only pass, but for a variant already
    built with -Werror from these very sources (the build cache is keyed by flags and
    sources; test_other_instruction_set_variants_agree builds the lower variants so), whose
    full compile was the same check and more."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in include_paths("cpu")]
    src = kernel_build.source_dir()

    def check(variant: str, source: str) -> tuple[str, str, int, str]:
        cmd = [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-fPIC",
               *kernel_build.flags(variant, werror=True), *includes, str(src / source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return variant, source, proc.returncode, proc.stderr[-3000:]

    def built_with_werror(variant: str) -> bool:
        out = kernel_build.build_directory(variant, kernel_build.flags(variant, werror=True), src)
        return (out / f"fleetllm_{out.name.replace('-', '_')}.so").is_file()

    jobs = [(v, s) for v in kernel_build.variants() if not built_with_werror(v)
            for s in kernel_build.SOURCES]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one compiler per core
        for variant, source, rc, stderr in pool.map(lambda job: check(*job), jobs):
            assert rc == 0, (variant, source, stderr)


def test_variants_never_target_the_build_machine(tmp_path):
    """The old cache was keyed by x86's /proc/cpuinfo flags line only: on aarch64 every CPU
    shared one key, and a -march=native library built on one CPU was loaded on another. Now
    no variant chooses instructions for the building CPU (-mtune=native only schedules them:
    correct anywhere); aarch64 builds the portable variant, and the build directory is keyed
    by what is compiled, so it may be shared between machines."""
    for variant in kernel_build.ISA_FLAGS:
        assert not [f for f in kernel_build.flags(variant)
                    if f.startswith(("-march=", "-mcpu=")) or f == "-mnative"]
    assert kernel_build.variants("aarch64") == ["portable"]
    assert kernel_build.best_variant("aarch64", "SVE256") == "portable"
    assert kernel_build.best_variant("x86_64", "AVX2") == "avx2"
    assert kernel_build.best_variant("x86_64", "DEFAULT") == "portable"
    copy = tmp_path / "csrc"
    copy.mkdir()
    for p in kernel_build.source_dir().iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    flags = kernel_build.flags("portable")
    same = kernel_build.build_directory("portable", flags, copy)
    assert same == kernel_build.build_directory("portable", flags, kernel_build.source_dir())
    (copy / "pool.h").write_text((copy / "pool.h").read_text() + "\n// changed\n")
    assert kernel_build.build_directory("portable", flags, copy) != same


@needs_kernels
@not_under_sanitizer
def test_a_dead_builders_lock_does_not_block_the_next_process():
    """torch's build lock is a plain file, which a builder killed mid-build leaves behind: the
    next process used to wait for it forever. It holds an flock around the build instead, so a
    lock file found then is stale and removed."""
    variant = kernel_build.chosen_variant()
    built = kernel_build.build_directory(variant, kernel_build.flags(variant),
                                         kernel_build.source_dir())
    (built / "lock").touch()
    python("from fleetllm.kernels import cpu_kernels; assert cpu_kernels.available()",
           timeout=120)
    assert not (built / "lock").exists()


def test_a_variant_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(kernel_build, "best_variant", lambda: "avx2")
    monkeypatch.setenv("FLEETLLM_CPU_ISA", "avx512")
    with pytest.raises(kernel_build.BuildError, match="runs at most 'avx2'"):
        kernel_build.chosen_variant()
    monkeypatch.setenv("FLEETLLM_CPU_ISA", "sse9")
    with pytest.raises(kernel_build.BuildError, match="not one of"):
        kernel_build.chosen_variant()


@not_under_sanitizer
@pytest.mark.parametrize("how", ["no compiler", "FLEETLLM_CPU_KERNELS=0"])
def test_without_a_compiler_the_pytorch_path_gives_the_same_tokens(how, tiny_models, tmp_path):
    """A fresh build with CXX naming a compiler that does not exist (and an empty build
    directory) fails, warns once, and the engine runs on the pure-PyTorch path: the same
    greedy tokens as with the kernels, logprobs to fp32 rounding. (On a machine that really
    has no compiler, the engine runs and the comparison is left to the HF parity tests.)"""
    code = f"""
        import json, logging
        logging.basicConfig(level=logging.WARNING)
        from fleetllm import LLM, SamplingParams
        from fleetllm.kernels import cpu_kernels
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        prompts = [{{"prompt_token_ids": list(range(5 + i, 30 + 7 * i))}} for i in range(3)]
        with LLM({str(tiny_models["qwen2_bias"])!r}, kv_cache_memory=16 << 20) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        print(json.dumps([cpu_kernels.available(),
                          [(c.token_ids, [{{str(k): v.logprob for k, v in d.items()}}
                                          for d in c.logprobs])
                           for o in outs for c in o.outputs]]))
        """
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.update({"CXX": str(tmp_path / "no-such-c++"), "CC": str(tmp_path / "no-such-cc")}
               if how == "no compiler" else {"FLEETLLM_CPU_KERNELS": "0"})
    without = python(code, env)
    kernels_off, runs = json.loads(without.stdout.strip().splitlines()[-1])
    assert not kernels_off and runs
    if not cpu_kernels.available():  # no compiler here either: nothing to compare with
        return
    kernels_on, want = json.loads(python(code).stdout.strip().splitlines()[-1])
    assert kernels_on
    if how == "no compiler":
        assert "CPU kernels are unavailable" in without.stderr
        assert not list((tmp_path / "ext").rglob("*.so"))
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs, want, strict=True):
        assert tokens == want_tokens
        for got, exp in zip(logprobs, want_logprobs, strict=True):
            assert got.keys() == exp.keys()
            assert all(abs(got[k] - exp[k]) < 1e-4 for k in got)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")
@tool_not_under_sanitizer
def test_the_peak_tool_builds_and_prints_a_rate_per_instruction(tmp_path):
    """tools/fma_peak.c, the arithmetic bound the docs quote beside the matmul rates: built as
    its header says and run briefly, it prints a rate per instruction (or says why not)."""
    exe = tmp_path / "fma_peak"
    subprocess.run(["cc", "-O2", "-march=native", "-Wall", "-Wextra", "-Werror",
                    str(REPO / "tools" / "fma_peak.c"), "-o", str(exe)], check=True, timeout=120)
    out = subprocess.run([str(exe), "0.02"], capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    names = [line.split(":")[0].split(" (")[0] for line in out]
    assert names == ["float32 FMA", "bf16 dot product"], out
    for line in out:
        if "GFLOP/s" in line:
            assert float(line.split(": ")[1].split()[0]) > 0, line


@pytest.mark.skipif(not cpu_kernels.available() or not {"avx512f", "clflushopt"} <= set(
    Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else True,
    reason="no C++ compiler, or a CPU without AVX-512F and CLFLUSHOPT")
@tool_not_under_sanitizer
def test_the_stream_pollution_tool_builds_and_times_each_way_of_reading(tmp_path):
    """tools/stream_pollution.c (whether any way of reading 200 MiB keeps the host's working
    set cached): built as its header says, run, it prints a warm walk and a rate and a walk
    after each of its five ways of reading."""
    exe = tmp_path / "stream_pollution"
    subprocess.run(["cc", "-O2", "-march=native", "-Wall", "-Wextra", "-Werror",
                    str(REPO / "tools" / "stream_pollution.c"), "-o", str(exe)], check=True,
                   timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True,
                         timeout=120).stdout.splitlines()
    assert out[0].startswith("walk of the 4 MiB working set, warm: ") and len(out) == 6, out
    for line in out[1:]:
        assert float(line.split(" read ")[1].split()[0]) > 0 and "walk after it" in line, line


@pytest.fixture(scope="module")
def ab_tools(tmp_path_factory) -> dict:
    """The A/B tools built so far in this module (tool name -> executable; "dir": where)."""
    return {"dir": tmp_path_factory.mktemp("ab-tools")}


@needs_kernels
@tool_not_under_sanitizer
@pytest.mark.parametrize("tool, source, args, first", [
    ("gemm_pairs_ab.cpp", "gemm.cpp", ["2", "1"], "M=2 mean old "),
    ("gemm_pairs_ab.cpp", "gemm.cpp", ["72", "1", "1b", "1"], "M=72 mean old "),
    ("decode_ab.cpp", "paged_decode.cpp", ["8", "1"], "B=8 mean old "),
    ("decode_ab.cpp", "paged_decode.cpp", ["1", "1", "16", "14", "2"], "B=1 mean old "),
    ("gemv_ab.cpp", "gemv.cpp", ["1", "1"], "M=1 mean old "),
])
def test_an_ab_tool_builds_two_trees_and_times_them_in_turn(ab_tools, tool, source, args,
                                                             first):
    """tools/gemm_pairs_ab.cpp, tools/decode_ab.cpp and tools/gemv_ab.cpp, the measurements
    behind the kernels' layouts and splits: built as their headers say (here this tree as both
    builds, one renamed), run for a round, each prints both builds' times (of a 125M decode
    step's GEMMs by pairs or by the GEMV; of its attention) and their ratio; decode_ab also
    with a stream read before each pass, as a step's weights evict a small batch's K/V, on
    other heads (Qwen2-0.5B's); gemm_pairs_ab also on a layer of Llama-1B's shapes at more
    rows than a decode step's (a prompt's)."""
    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("this CPU has neither AVX2 nor AVX-512")
    exe = ab_tools.get(tool)
    if exe is None:  # built once per tool for the cases that run it
        # the kernels' flags, for the variant this CPU runs
        flags = [*kernel_build.COMMON_FLAGS, *kernel_build.ISA_FLAGS[kernel_build.best_variant()]]
        csrc = REPO / "csrc"
        root = ab_tools["dir"] / tool
        root.mkdir()
        old, exe = root / "old.o", root / "ab"
        cxx = os.environ.get("CXX", "c++")  # as fleetllm/kernels/build.py compiles
        for cmd in ([cxx, *flags, f"-I{csrc}", "-Dfleetllm=fold", "-c", str(csrc / source),
                     "-o", str(old)],
                    [cxx, *flags, "-Werror=comment", f"-I{csrc}",  # flags has -Wall -Wextra
                     str(REPO / "tools" / tool), str(csrc / source), str(csrc / "pool.cpp"),
                     str(old), "-o", str(exe)]):
            built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert built.returncode == 0 and not built.stderr, (cmd, built.stderr[-3000:])
        ab_tools[tool] = exe
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True,
                         timeout=120).stdout.splitlines()
    if tool == "decode_ab.cpp" and len(args) > 2:  # 3rd: MiB read first (cold K/V)
        assert out[0] == f"each pass after reading {args[2]} MiB", out
        out = out[1:]
    assert len(out) == 2 and out[1].startswith(first), out
    assert float(out[1].rsplit("new/old ", 1)[1]) > 0, out


def _pairs_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T as vdpbf16ps sums it, per output: float32, k's pairs in order, each pair's
    upper product added first (bf16 products are exact in float32), then the bias, one
    rounding to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    return (acc if bias is None else acc + bias.float()).bfloat16()


@needs_kernels
def test_gemm_on_weights_packed_by_pairs_sums_each_output_in_one_order():
    """The bf16 GEMM of linear_kernels.Pairs (csrc/gemm.cpp: 8 rows x 48 outputs a pass, k in
    blocks of 512 pairs, rows split evenly into groups) gives every output the reference's
    bits: one float32 lane over k's pairs in order, the bias, one rounding. So a row's result
    does not depend on how many rows share the call or on where the groups split. Random
    shapes: 1-300 rows, output counts that leave partial 16- and 48-wide panels, k of 2 to 1,030
    (two k blocks)."""
    from fleetllm.model.linear_kernels import Pairs

    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("this CPU has no AVX-512")
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    for case in range(24):
        m = rng.choice([1, 2, 5, 8, 9, 16, 17, 33, 64, 71, 140, 300])
        n = rng.choice([1, 7, 16, 17, 48, 49, 95, 130])
        k = rng.choice([2, 6, 64, 250, 1030])
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16() if case % 2 else None
        packed = Pairs.pack(w)
        assert torch.equal(packed.to_dense(), w)
        # one sequential stream: panel i's pair p is outputs 48i..48i+47's k = 2p, 2p + 1,
        # side by side (the panel's 3 vectors), pairs in order, panels in order
        assert packed.tensor.shape == (-(-n // 48), k // 2, 48, 2)
        i, p = rng.randrange(packed.tensor.shape[0]), rng.randrange(k // 2)
        rows = w[48 * i:48 * i + 48, 2 * p:2 * p + 2]
        assert torch.equal(packed.tensor[i, p, :len(rows)], rows)
        assert not packed.tensor[i, p, len(rows):].any()  # zero past N
        got = packed(x, bias)
        assert torch.equal(got, _pairs_reference(x, w, bias)), (m, n, k)
    with pytest.raises(RuntimeError, match="even"):
        cpu_kernels.gemm_pairs(torch.zeros(2, 3, dtype=torch.bfloat16),
                               torch.zeros(1, 1, 16, 2, dtype=torch.bfloat16), None, 16)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_kernels.gemm_pairs(torch.zeros(2, 4, dtype=torch.bfloat16),
                               torch.zeros(1, 2, 16, 2, dtype=torch.bfloat16), None, 17)


_PAIRS_CASES = """
import random, sys, torch
from fleetllm.kernels import cpu_kernels
from fleetllm.model.linear_kernels import Pairs
assert cpu_kernels.available()
rng, g = random.Random(6), torch.Generator().manual_seed(6)
cases = []
for case in range(16):
    m, n = rng.choice([1, 3, 8, 9, 64, 71, 300]), rng.choice([1, 17, 48, 95, 130])
    k = rng.choice([2, 250, 1030, 2100])
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if case % 2 else None
    cases.append((x, w, bias, Pairs.pack(w)(x, bias)))
torch.save({"cases": cases, "build_info": cpu_kernels.build_info()}, sys.argv[1])
"""


@needs_kernels
@not_under_sanitizer
@pytest.mark.parametrize("mode", ["fma", "dot", "no-dot"])
def test_gemm_by_pairs_gives_the_same_bits_by_fmas_or_by_vdpbf16ps(mode, tmp_path):
    """gemm_pairs makes its sums by vdpbf16ps or, where that runs at under two thirds of the
    FMAs' rate (an Intel Xeon without AMX: half) or is missing (AVX-512 without BF16: Ice Lake,
    Cascade Lake; simulated by FLEETLLM_CPU_BF16_DOT=0, "no-dot"), by FMAs on the pairs widened
    in registers (FLEETLLM_CPU_BF16_PAIRS=fma | dot; unset, measured once a process). Both give
    every output the reference's bits (the upper product, then the lower, each rounded), so
    which one a process picks never changes a token: random shapes of 1-300 rows, partial
    panels, k of up to 2,100 (three blocks of k), with and without a bias. (Prompt attention
    takes its float32 loops in the fma mode: test_bf16_dot_products_and_the_loops_they_replace_agree
    holds their bits to vdpbf16ps's.)"""
    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("this CPU has no AVX-512")
    if mode == "dot" and "avx512bf16" not in cpu_kernels.build_info():
        pytest.skip("this CPU has no AVX-512 BF16: its pairs are summed by FMAs")
    out = tmp_path / f"{mode}.pt"
    env = {"FLEETLLM_CPU_BF16_DOT": "0"} if mode == "no-dot" else \
        {"FLEETLLM_CPU_BF16_PAIRS": mode}
    python(f"import sys; sys.argv = ['', {str(out)!r}]; exec({_PAIRS_CASES!r})", env=env)
    run = torch.load(out)
    assert ("(pairs by fma)" in run["build_info"]) == (mode != "dot"), run["build_info"]
    assert ("avx512bf16" in run["build_info"]) == (
        mode != "no-dot" and "avx512bf16" in cpu_kernels.build_info()), run["build_info"]
    for x, w, bias, got in run["cases"]:
        assert torch.equal(got, _pairs_reference(x, w, bias)), (x.shape, w.shape)


@needs_kernels
def test_gemm_on_amx_tiles_is_the_product_and_independent_of_the_batch():
    """The bf16 GEMM on AMX tiles (linear_kernels.Amx, csrc/gemm_amx.cpp: 32 outputs by up to
    32 rows a pass, row tails of any size) gives float32 sums over k rounded once: each row's
    bits are the same alone or in any batch, the bias is added before the rounding, and the
    result is x @ w.T within bf16 rounding. Random shapes: 1-300 rows, 32-160 outputs, k of
    32-1,024; the packed layout is checked element by element."""
    from fleetllm.model.linear_kernels import Amx

    if not cpu_kernels.amx_available():
        pytest.skip("this CPU has no AMX tiles")
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    for case in range(16):
        m = rng.choice([1, 2, 15, 16, 17, 31, 33, 64, 71, 140, 300])
        n = rng.choice([32, 64, 96, 160])
        k = rng.choice([32, 64, 256, 768, 1024])
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16() if case % 2 else None
        packed = Amx.pack(w)
        assert torch.equal(packed.to_dense(), w)
        i, j = rng.randrange(n), rng.randrange(k)
        assert packed.tensor.shape == (n // 32, k // 32, 2, 16, 32)
        assert packed.tensor[i // 32, j // 32, i % 32 // 16, j % 32 // 2, i % 16 * 2 + j % 2] \
            == w[i, j]
        got = packed(x, bias)
        want = x.float() @ w.float().T + (0 if bias is None else bias.float())
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
        for r in {0, m // 2, m - 1}:  # alone, and as the first row of another batch
            assert torch.equal(packed(x[r:r + 1], bias), got[r:r + 1])
            assert torch.equal(packed(x[r:], bias)[0], got[r])
    with pytest.raises(RuntimeError, match="multiples of 32"):
        cpu_kernels.gemm_amx(torch.zeros(2, 32, dtype=torch.bfloat16),
                             torch.zeros(1, 1, 2, 16, 32, dtype=torch.bfloat16), None, 48)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_kernels.gemm_amx(torch.zeros(2, 64, dtype=torch.bfloat16),
                             torch.zeros(1, 1, 2, 16, 32, dtype=torch.bfloat16), None, 32)


def test_a_packed_copy_that_disagrees_with_f_linear_is_not_used(monkeypatch, caplog):
    """select_kernels checks each copy against F.linear; one that differs (a broken kernel,
    an odd CPU) leaves the model on its dense weights, with a warning saying why."""
    from torch import nn

    from fleetllm.model import kernel_choice, layers, linear_kernels

    if not kernel_choice._can_pack(torch.zeros(1, 1)):
        pytest.skip("no oneDNN linear here")
    monkeypatch.setenv("FLEETLLM_LINEAR", "packed")
    proj = layers.ColumnParallelLinear(64, [(96, 96, 0)], bias=False)
    # set, not left as allocated: uninitialized memory may hold NaNs, which torch.equal refuses
    proj.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    dense = proj.weight.detach().clone()
    real = linear_kernels.OneDnn.matmul
    monkeypatch.setattr(linear_kernels.OneDnn, "matmul", lambda *a: real(*a) + 1)
    with caplog.at_level("WARNING", logger=kernel_choice.__name__):
        assert kernel_choice.select_kernels(nn.ModuleList([proj])) == 0
    assert "differs from F.linear" in caplog.text
    assert proj.kernel.kind in (None, LinearKind.GEMV) and torch.equal(proj.weight, dense)
    assert proj.kernel.for_rows(100).kind is None  # F.linear past the GEMV's rows


@needs_kernels
def test_float32_projections_take_mkls_packed_sgemm_on_intel_cpus(monkeypatch):
    """On an Intel CPU with torch's MKL (linear_kernels.Mkl) a float32 projection whose dense
    weight stays (for the GEMV's small batches) gets MKL's packed copy in place of oneDNN's:
    F.linear's products, the bias added as its addmm adds it, at any number of rows, and
    decoder_layer reads it (tests/kernels/test_attention.py checks the one-call layers' bits). Where
    the dense weight goes (FLEETLLM_LINEAR=packed), oneDNN's copy, which can be unpacked."""
    import torch.nn.functional as F
    from torch import nn

    from fleetllm.model import kernel_choice, layers
    from fleetllm.model.linear_kernels import Mkl, OneDnn

    if not cpu_kernels.mkl_available():
        pytest.skip("no MKL on an Intel CPU here")
    g = torch.Generator().manual_seed(0)
    for mode, kind in (("auto", Mkl), ("packed", OneDnn)):
        monkeypatch.setenv("FLEETLLM_LINEAR", mode)
        proj = layers.ColumnParallelLinear(96, [(200, 200, 0)], bias=True)
        proj.weight.data = torch.randn(200, 96, generator=g)
        proj.bias.data = torch.randn(200, generator=g)
        dense, bias = proj.weight.detach().clone(), proj.bias.detach().clone()
        assert kernel_choice.select_kernels(nn.ModuleList([proj])) == 1
        assert isinstance(proj.kernel.for_rows(300), kind), mode
        assert (proj.weight is None) == (mode == "packed")
        for rows in (5, 64, 300):
            x = torch.randn(rows, 96, generator=g)
            torch.testing.assert_close(proj(x), F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)
    packed = Mkl(dense)
    x = torch.randn(7, 96, generator=g)
    with pytest.raises(RuntimeError, match="too small"):
        cpu_kernels.mkl_linear(x, packed.tensor[:100], None, 200)
    with pytest.raises(RuntimeError, match="must be Float"):
        cpu_kernels.mkl_linear(x.bfloat16(), packed.tensor, None, 200)
