"""Random PEFT LoRA adapters for the tests' tiny checkpoints, and the HF + peft reference."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import load_hf

from fleetllm import LoRARequest

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, r: int = 8, alpha: float = 16, targets=None,
                 rslora: bool = False, seed: int = 0, scale: float = 0.15, **extra) -> Path:
    """A PEFT LoRA adapter for `base` with random A and B (PEFT starts B at zero, which would
    make every adapter the base model), saved as safetensors."""
    from peft import LoraConfig, get_peft_model

    model = load_hf(base)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ATTN),
                        use_rslora=rslora, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def hf_lora_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int,
                   merge: bool = False) -> list[list[int]]:
    """Greedy tokens of HF transformers with the adapter applied by peft (PeftModel, or merged
    into the weights with merge_and_unload); adapter None: the base model."""
    from peft import PeftModel

    model = load_hf(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
        if merge:
            model = model.merge_and_unload().eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(seq[0, len(prompt):].tolist())
    return outs


def lora_request(adapter: Path, lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter{lora_id}", lora_id, str(adapter))
