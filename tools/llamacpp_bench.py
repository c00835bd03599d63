"""llama.cpp as a batch-1 peer: write a Llama checkpoint directory as a bf16 GGUF and time
its decode with llama-bench (built by `make llamacpp`), the figure to set beside
`fleetllm bench latency --batch-size 1 --dtype bfloat16` on the same checkpoint.

    .venv/bin/python tools/llamacpp_bench.py DIR [--input-len 128] [--output-len 128]

The GGUF is written once (.peers/gguf/) with the gguf package of the same llama.cpp tree: the
weights in bf16 as llama.cpp's own converter writes them (q and k rows permuted to its rotary
layout) and a placeholder vocabulary of the checkpoint's size (llama-bench decodes token ids;
no string is read). llama-bench then decodes --output-len tokens after a context of
--input-len (`tg128 @ d128`), KV cache in bf16, on as many threads as torch uses here, and
prints its mean and standard deviation over --repetitions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP = ROOT / ".peers" / "llama.cpp"


def write_gguf(src: Path, shards: list[Path], out: Path) -> None:
    sys.path.insert(0, str(LLAMACPP / "gguf-py"))
    import gguf

    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise SystemExit(f"{src}: model_type {cfg.get('model_type')!r}: only Llama-shaped "
                         "checkpoints (llama, mistral) are written")
    weights: dict[str, torch.Tensor] = {}
    for f in shards:
        weights.update(load_file(f))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control, control, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name: str, t: torch.Tensor) -> None:
        a = t.to(torch.float32).numpy()
        if a.ndim == 2:  # matrices in bf16, norms in float32 (as the converter does)
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, a)

    def rotary(t: torch.Tensor, n: int) -> torch.Tensor:  # HF halves -> llama.cpp pairs
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(
            t.shape)

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", rotary(weights[p + "self_attn.q_proj.weight"], heads))
        put(f"blk.{i}.attn_k.weight", rotary(weights[p + "self_attn.k_proj.weight"], kv_heads))
        put(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights:  # tied embeddings: llama.cpp reads token_embd
        put("output.weight", weights["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a Llama checkpoint directory (safetensors)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    bench = LLAMACPP / "build" / "bin" / "llama-bench"
    if not bench.exists():
        raise SystemExit(f"{bench} is missing: run `make llamacpp` first")
    shards = sorted(args.model.glob("*.safetensors"))
    if not shards:
        raise SystemExit(f"{args.model}: no *.safetensors files")
    # One GGUF per checkpoint directory (its path, not only its name: two `model/` folders
    # must not share one), written again when a shard is newer.
    source = args.model.resolve()
    tag = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    out = ROOT / ".peers" / "gguf" / f"{source.name}-{tag}-bf16.gguf"
    if not out.exists() or out.stat().st_mtime < max(f.stat().st_mtime for f in shards):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(args.model, shards, out)
    run = subprocess.run([str(bench), "-m", str(out), "-p", "0", "-n", str(args.output_len),
                          "-d", str(args.input_len), "-t", str(args.threads), "-ctk", "bf16",
                          "-ctv", "bf16", "-r", str(args.repetitions), "-o", "json"],
                         capture_output=True, text=True, timeout=1800, check=True)
    [row] = json.loads(run.stdout)
    print(f"llama.cpp ({row.get('build_commit', '?')}): {row['avg_ts']:.1f} +- "
          f"{row['stddev_ts']:.1f} decode tokens/s (tg{args.output_len} @ d{args.input_len}, "
          f"bf16 weights and KV cache, {args.threads} threads, {args.repetitions} runs)")


if __name__ == "__main__":
    main()
