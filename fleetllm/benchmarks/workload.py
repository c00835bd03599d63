"""What the benchmarks run and what the hardware could do with it: requests (random with
length ranges, a JSONL file, a shared prefix), the workload's FLOPs, and the machine's matmul
rate and memory read bandwidth measured in the same process."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fleetllm.config import ArchConfig
from fleetllm.model import huge_pages
from fleetllm.model.linear_kernels import Amx, Mkl, OneDnn, Pairs


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class TimedRun:
    """A round an engine timed itself (one in another process: its own clock around the
    generation, not the transfer of requests and outputs)."""

    outputs: list[list[int]]
    seconds: float


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '16:256' (or 16-256) -> (16, 256), inclusive."""
    for sep in (":", "-"):
        if sep in text:
            low, high = (int(x) for x in text.split(sep, 1))
            break
    else:
        low = high = int(text)
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 0 < LOW <= HIGH, "
                                         f"got {text!r}")
    return low, high


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: str, input_len: str,
                      output_len: str) -> None:
    """The request flags; the defaults are stated in the help (they depend on --preset)."""
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"requests (default: {num_prompts})")
    parser.add_argument("--input-len", type=parse_range, default=None,
                        help=f"prompt tokens, N or LOW:HIGH drawn uniformly (default: "
                             f"{input_len})")
    parser.add_argument("--output-len", type=parse_range, default=None,
                        help=f"generated tokens per request, N or LOW:HIGH (default: "
                             f"{output_len})")
    parser.add_argument("--dataset", default=None,
                        help="JSONL file of requests instead of random ones: one object per "
                             "line with prompt_token_ids (or prompt, with a tokenizer) and "
                             "output_len (or max_tokens) (default: random prompts)")
    parser.add_argument("--data-seed", dest="bench_seed", type=int, default=0,
                        help="seed for the random prompts")


def make_requests(args: argparse.Namespace, vocab: int, tokenizer=None,
                  shared_prefix: int = 0) -> list[Request]:
    """--dataset, else --num-prompts random prompts (tokens 3..vocab-1) with lengths drawn
    from --input-len / --output-len; with shared_prefix, each prompt is one common random
    prefix of that many tokens followed by its own part."""
    if args.dataset:
        return _read_dataset(Path(args.dataset), tokenizer, args.output_len)
    rng = random.Random(args.bench_seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    requests = []
    for _ in range(args.num_prompts):
        n = rng.randint(*args.input_len)
        out = rng.randint(*args.output_len)
        requests.append(Request(prefix + [rng.randrange(3, vocab) for _ in range(n)], out))
    return requests


def _read_dataset(path: Path, tokenizer, output_len: tuple[int, int] | None) -> list[Request]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "prompt_token_ids" in item:
            ids = list(item["prompt_token_ids"])
        elif tokenizer is not None:
            ids = tokenizer.encode(item["prompt"])
        else:
            raise ValueError(f"{path}:{number}: a text prompt needs a tokenizer; give "
                             "prompt_token_ids")
        out = item.get("output_len") or item.get("max_tokens") or (output_len or (64, 64))[1]
        requests.append(Request(ids, int(out)))
    return requests


# ------------------------------------------------------------------------------- FLOPs


def copy_edit_prompts(tokenizer, count: int, max_len: int, seed: int = 0,
                      sources: list[str] | None = None) -> list[list[int]]:
    """A copy-heavy workload (code editing): each prompt holds a Python function, then asks
    for it again under a new name, and starts the copy. A model that copies repeats long
    spans of its prompt: what n-gram speculative decoding drafts. The functions are
    `sources` (their source texts), by default fleetllm's own (not the demo model's training
    text); those whose prompt has at most max_len tokens, one per prompt, cycling."""
    import inspect

    if sources is None:
        from fleetllm.core import block_manager, scheduler
        from fleetllm.engine import detokenizer
        from fleetllm.worker import sampler

        sources = [inspect.getsource(f).strip()
                   for module in (sampler, scheduler, block_manager, detokenizer)
                   for f in vars(module).values()
                   if inspect.isfunction(f) and f.__module__ == module.__name__
                   and 300 < len(inspect.getsource(f)) < 1500]
    candidates = []
    for source in sources:
        old = source.split("(", 1)[0].removeprefix("def ")
        new = f"{old}_v2"
        text = (f"{source}\n\n\n# The same function, renamed to {new}:\n"
                f"{source.split(chr(10), 1)[0].replace(old, new, 1)}\n")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_len:
            candidates.append(ids)
    if not candidates:
        raise ValueError(f"no copy-edit prompt fits in {max_len} tokens")
    random.Random(seed).shuffle(candidates)
    return [candidates[i % len(candidates)] for i in range(count)]


def linear_params(a: ArchConfig, experts_read: float | None = None) -> int:
    """Weights multiplied per token through the decoder layers (no embedding, no LM head).
    A mixture of experts' layer counts its router, shared expert and `experts_read` experts
    (default: the experts_per_token a token goes through)."""
    d = a.head_dim
    attention = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * d + \
        a.num_heads * d * a.hidden_size
    dense = 3 * a.hidden_size * a.intermediate_size
    experts = a.experts_per_token if experts_read is None else experts_read
    sparse = a.num_experts * a.hidden_size + 3 * a.hidden_size * (
        experts * a.moe_intermediate_size + a.shared_expert_intermediate_size)
    if a.shared_expert_intermediate_size:
        sparse += a.hidden_size  # the shared expert's gate
    moe = len(a.moe_layers)
    return int(attention * a.num_layers + dense * (a.num_layers - moe) + sparse * moe)


def weight_bytes(a: ArchConfig, dtype_bytes: int, batch: int = 1) -> int:
    """Bytes a decode step of `batch` rows reads from the weights stored with dtype_bytes per
    element: every projection and its bias, the norms and the LM head; of a mixture of
    experts, the experts expected to be picked by some row (E (1 - (1 - k/E)^batch) of E,
    routing taken as uniform). The embedding table is read only at
    the batch's rows, so it counts once, as the LM head: the same matrix when the embeddings
    are tied, and a table of which a step touches a few rows when not."""
    norms = (2 * a.num_layers + 1) * a.hidden_size
    if a.qk_norm:
        norms += 2 * a.num_layers * a.head_dim
    qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    biases = a.num_layers * ((qkv if a.qkv_bias else 0) + (a.hidden_size if a.o_bias else 0)
                             + ((2 * a.intermediate_size + a.hidden_size) if a.mlp_bias else 0))
    read = None
    if a.num_experts:
        read = a.num_experts * (1 - (1 - a.experts_per_token / a.num_experts) ** batch)
    return (linear_params(a, read) + a.vocab_size * a.hidden_size + norms + biases) \
        * dtype_bytes


def gguf_weight_bytes(path: str) -> int:
    """weight_bytes for a GGUF file: its tensors' bytes as stored, the embedding counted
    once as above (it is the LM head when tied; else a few rows of it are read)."""
    from fleetllm.config_gguf import open_gguf

    infos = open_gguf(path).tensor_infos
    total = sum(int(t.n_bytes) for t in infos.values())
    if "output.weight" in infos and "token_embd.weight" in infos:
        total -= int(infos["token_embd.weight"].n_bytes)
    return total


def gguf_file_type(path: str) -> str:
    """The GGUF's most common matrix type (Q4_K for a Q4_K_M file)."""
    from collections import Counter

    from fleetllm.config_gguf import open_gguf
    from fleetllm.quant.packed import QType

    counts = Counter(QType(int(t.tensor_type)).name for t in
                     open_gguf(path).tensor_infos.values() if len(t.shape) == 2)
    return counts.most_common(1)[0][0]


def hf_quantization(model: str) -> dict | None:
    """A Hugging Face checkpoint directory's quantization_config (AWQ, GPTQ,
    compressed-tensors: config_quant.py); None for others (unquantized, a GGUF file)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text()).get("quantization_config")
    return raw if isinstance(raw, dict) else None


def hf_quant_name(q: dict) -> str:
    """The checkpoint format's short name: AWQ, GPTQ, or compressed-tensors' W<bits>A<bits>
    (A16: float activations), as `fleetllm quantize --type` names them."""
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    if method.startswith("awq") or method == "auto-awq":
        return "AWQ"
    if "gptq" in method or method == "marlin":
        return "GPTQ"
    groups = list((q.get("config_groups") or {}).values()) or [{}]
    weights = groups[0].get("weights") or {}
    acts = groups[0].get("input_activations") or {}
    return f"W{weights.get('num_bits', '?')}A{acts.get('num_bits', 16)}"


def hf_quant_label(q: dict) -> str:
    """The format in words for a benchmark's header: "AWQ 4-bit, group 128", "GPTQ 4-bit,
    group 128, sym", "W8A8 (compressed-tensors int-quantized, channel)"."""
    name = hf_quant_name(q)
    if name in ("AWQ", "GPTQ"):
        size = q.get("group_size", -1)
        out = f"{name} {q.get('bits', '?')}-bit, " + \
            ("per channel" if size in (-1, None) else f"group {size}")
        if name == "GPTQ":
            out += ", sym" if q.get("sym", True) else ", asym"
            out += ", desc_act" if q.get("desc_act") else ""
        return out
    groups = list((q.get("config_groups") or {}).values()) or [{}]
    weights = groups[0].get("weights") or {}
    strategy = weights.get("strategy") or "?"
    if strategy == "group":
        strategy = f"group {weights.get('group_size')}"
    if weights.get("symmetric") is False:
        strategy += ", asym"
    if weights.get("actorder"):
        strategy += f", actorder {weights['actorder']}"
    return f"{name} (compressed-tensors {q.get('format', '?')}, {strategy})"


def hf_weight_bytes(model: str) -> int:
    """weight_bytes for a quantized checkpoint directory: its safetensors tensors' bytes as
    stored (packed weights, scales, zero points), the embedding counted once as above (when
    the LM head is its own matrix, a step reads a few embedding rows)."""
    sizes: dict[str, int] = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        sizes.update({name: info["data_offsets"][1] - info["data_offsets"][0]
                      for name, info in header.items() if name != "__metadata__"})
    total = sum(sizes.values())
    if "lm_head.weight" in sizes:
        total -= sizes.get("model.embed_tokens.weight", 0)
    return total


def kv_bytes_per_token(a: ArchConfig, dtype_bytes: int) -> int:
    """Bytes of KV cache one token position holds (keys and values, every layer)."""
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * dtype_bytes


@dataclass
class Flops:
    prefill: float  # projections + attention of prompt tokens
    decode: float  # projections + attention of generated tokens fed back
    lm_head: float  # one logits row per generated token

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.lm_head


def workload_flops(a: ArchConfig, requests: list[Request]) -> Flops:
    """Exact FLOPs of serving the requests: 2 per multiply-add of the projections for every
    token fed through the model (the prompt, then each generated token but the last), causal
    attention (q.k and p.v: 4 * positions * heads * head_dim per token and layer), and the LM
    head once per generated token."""
    lin = 2 * linear_params(a)
    attn = 4 * a.num_heads * a.head_dim * a.num_layers  # per (token, visible position)
    prefill = decode = 0.0
    for r in requests:
        p, o = len(r.prompt), r.output_len
        prefill += lin * p + attn * p * (p + 1) / 2  # positions 0..p-1 see 1..p keys
        fed = max(o - 1, 0)  # decode tokens at positions p..p+o-2 see p+1..p+o-1 keys
        decode += lin * fed + attn * (fed * (p + 1) + fed * (fed - 1) / 2)
    lm_head = 2.0 * a.vocab_size * a.hidden_size * sum(r.output_len for r in requests)
    return Flops(prefill, decode, lm_head)


# ---------------------------------------------------------------------------- hardware


def _best_time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_rate(a: ArchConfig, rows: int, dtype: torch.dtype = torch.float32,
                repeat: int = 3) -> dict[str, float]:
    """GFLOP/s of the model's own projections at `rows` rows in `dtype` (the engine's), the
    way a forward streams them: every layer's four projections with their own weights (so they
    come from memory, not a cache holding one matrix), then the LM head. Two implementations:
    plain F.linear (`x @ W.T`: MKL in float32, torch's own bf16 GEMM in bfloat16), oneDNN
    with pre-packed weights (what fleetllm runs for more than 4 rows), and for bf16 on CPUs with
    AVX-512 BF16 fleetllm's GEMM on weights packed by pairs (linear_kernels.Pairs, which
    replaces oneDNN there), for float32 on Intel CPUs MKL's packed sgemm (Mkl) and, with AMX,
    its GEMM on AMX tiles (Amx, beside oneDNN there for decode batches); "best" is the
    fastest, the machine's rate for the roofline. With more than 2 GiB of projection weights,
    only enough layers for 2 GiB are built."""
    d, hid = a.head_dim, a.hidden_size
    shapes = [((a.num_heads + 2 * a.num_kv_heads) * d, hid), (hid, a.num_heads * d),
              (2 * a.intermediate_size, hid), (hid, a.intermediate_size)]
    layer_bytes = dtype.itemsize * sum(o * i for o, i in shapes)
    layers = max(1, min(a.num_layers, (2 << 30) // layer_bytes))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:  # drawn in float32: any dtype
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    dense = [rand(*s, scale=0.02) for _ in range(layers) for s in shapes]
    dense.append(rand(a.vocab_size, hid, scale=0.02))
    inputs = {w.shape[1]: rand(rows, w.shape[1]) for w in dense}
    # Per token the layer shapes run num_layers times and the LM head once.
    flops = 2.0 * rows * (sum(o * i for o, i in shapes) * layers + a.vocab_size * hid)
    rates = {}
    with torch.inference_mode():
        rates["dense"] = flops / _best_time(
            lambda: [F.linear(inputs[w.shape[1]], w) for w in dense], repeat) / 1e9
        if torch.backends.mkldnn.is_available():
            try:
                packed = [(OneDnn(w), w.shape[1]) for w in dense]
                rates["packed"] = flops / _best_time(lambda: [
                    w(inputs[k]) for w, k in packed], repeat) / 1e9
            except RuntimeError:
                pass
            packed = []  # freed before the next copy
        if Mkl.applies(dense[0]):
            mkl = [(Mkl(w), w.shape[1]) for w in dense]
            rates["mkl"] = flops / _best_time(lambda: [w(inputs[k]) for w, k in mkl],
                                              repeat) / 1e9
            mkl = []
        if Pairs.applies(dense[0]):
            pairs = [(Pairs.pack(w), w.shape[1]) for w in dense]
            rates["pairs"] = flops / _best_time(lambda: [w(inputs[k]) for w, k in pairs],
                                                repeat) / 1e9
            pairs = []
        if all(Amx.applies(w) for w in dense):
            tiles = [(Amx.pack(w), w.shape[1]) for w in dense]
            rates["amx"] = flops / _best_time(lambda: [w(inputs[k]) for w, k in tiles],
                                              repeat) / 1e9
    rates["best"] = max(rates.values())
    return rates


def read_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    """Memory read bandwidth in GB/s: the best of `repeat` sums over a buffer much larger than
    any cache, with torch's threads. The buffer is in huge pages where the engine puts its
    weights there (model/huge_pages.py): the machine's best, not a rate 4 KiB pages hold
    down (a C read loop measured 5-8% slower on 4 KiB pages here)."""
    buf = huge_pages.zeros((mib * (1 << 20) // 4,), torch.float32).fill_(1.0)
    seconds = _best_time(lambda: buf.sum(), repeat)
    return buf.numel() * 4 / seconds / 1e9
