"""The worker's adapters: an LRU of loaded adapters (max_cpu_loras, host memory, this rank's
shards only) and max_loras device slots in every adapted projection (lora/layers.py).

A step names its adapters (SequenceGroupMetadata.lora_request); `prepare` loads any not
loaded yet from its lora_path, puts each in a slot (evicting a slot this step does not use)
and returns each group's slot. Pinned adapters (pin_lora) are never evicted from the LRU;
they keep their slot unless a step needs it for an adapter of its own (they are copied back
from host memory when used again). The scheduler keeps a step's adapters within max_loras.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from fleetllm.config_lora import LoRAConfig
from fleetllm.lora.layers import LoRASlots
from fleetllm.lora.peft import load_adapter
from fleetllm.lora.request import LoRARequest

# HF projection -> (our module under the decoder layer, part index within it)
_PLACE = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

# One loaded adapter: {(layer, our module): [per part (A^T, scaled B^T) or None]}
Loaded = dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]


def lora_torch_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return names.get(config.lora_dtype, model_dtype)


class LoRAManager:
    def __init__(self, config: LoRAConfig, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.cpu: OrderedDict[int, tuple[LoRARequest, Loaded]] = OrderedDict()  # LRU
        self.pinned: set[int] = set()
        self.slot_of: dict[int, int] = {}
        self.slot_ids: list[int | None] = [None] * config.max_loras
        self.modules: dict[tuple[int, str], Any] = {}

    def attach(self, model: torch.nn.Module) -> None:
        """Give every projection of this rank's layers its slots (again after the model was
        reloaded: the slots start empty, the loaded adapters stay)."""
        cfg = self.config
        self.modules = {}
        for index, layer in model.layers.items():
            for name in _MODULES:
                module = layer.get_submodule(name)
                if hasattr(module, "parts"):  # column parallel: its output parts' shards
                    sizes, in_size = [p[1] for p in module.parts], module.input_size
                else:
                    sizes, in_size = [module.output_size], module.shard
                module.lora = LoRASlots(in_size, sizes, cfg.max_loras, cfg.max_lora_rank,
                                        self.dtype, self.device)
                self.modules[(int(index), name)] = module
        self.slot_of.clear()
        self.slot_ids = [None] * cfg.max_loras

    # ------------------------------------------------------------------ the LRU

    def add(self, request: LoRARequest, keep: set[int] = frozenset()) -> bool:
        """Load the adapter into host memory (or mark it recently used). True once loaded."""
        rid = request.lora_int_id
        if rid in self.cpu:
            self.cpu.move_to_end(rid)
            return True
        self.cpu[rid] = (request, self._load(request))
        self._evict(keep | {rid})
        return True

    def _evict(self, keep: set[int]) -> None:
        for rid in list(self.cpu):
            if len(self.cpu) <= self.config.max_cpu_loras:
                break
            if rid not in keep and rid not in self.pinned:
                self.remove(rid)

    def remove(self, lora_id: int) -> bool:
        if self.cpu.pop(lora_id, None) is None:
            return False
        self.pinned.discard(lora_id)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
            for module in self.modules.values():
                module.lora.clear(slot)
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.cpu:
            return False
        self.pinned.add(lora_id)
        return True

    def list(self) -> set[int]:
        return set(self.cpu)

    def _load(self, request: LoRARequest) -> Loaded:
        """This rank's shards of the adapter, transposed for x @ A and with B scaled."""
        layers = {layer for layer, _ in self.modules}
        info, tensors = load_adapter(request.lora_path, self.config.max_lora_rank, layers)
        loaded: Loaded = {}
        for (layer, hf_name), (a, b) in tensors.items():
            ours, part = _PLACE[hf_name]
            module = self.modules[(layer, ours)]
            scale = info.scaling(a.shape[0])
            if hasattr(module, "parts"):  # column parallel: all of A, this rank's rows of B
                _, shard, start = module.parts[part]
                b = b.narrow(0, start, shard)
            else:  # row parallel: this rank's input columns of A, all of B
                a = a.narrow(1, module.start, module.shard)
            a_t = a.t().to(self.dtype).contiguous()
            b_t = (b.float() * scale).t().to(self.dtype).contiguous()
            parts = loaded.setdefault((layer, ours), [None] * len(module.lora.part_sizes))
            parts[part] = (a_t, b_t)
        return loaded

    # ------------------------------------------------------------------ a step

    def prepare(self, requests: list[LoRARequest | None]) -> list[int] | None:
        """Each group's slot (-1: the base model), loading and placing the step's adapters;
        None when no group has one."""
        needed = {r.lora_int_id: r for r in requests if r is not None}
        if not needed:
            return None
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters; max_loras is "
                               f"{self.config.max_loras}")
        for request in needed.values():
            self.add(request, keep=set(needed))
        for rid in needed:
            if rid not in self.slot_of:
                self._place(rid, needed)
        return [-1 if r is None else self.slot_of[r.lora_int_id] for r in requests]

    def _place(self, rid: int, needed: dict[int, LoRARequest]) -> None:
        free = [s for s, owner in enumerate(self.slot_ids) if owner is None]
        if not free:  # a slot this step does not use; unpinned ones first
            used = [s for s, owner in enumerate(self.slot_ids) if owner not in needed]
            used.sort(key=lambda s: self.slot_ids[s] in self.pinned)
            free = used[:1]
            del self.slot_of[self.slot_ids[free[0]]]
        slot = free[0]
        _, loaded = self.cpu[rid]
        for key, module in self.modules.items():
            parts = loaded.get(key)
            if parts is None:
                module.lora.clear(slot)
            else:
                module.lora.set(slot, parts)
        self.slot_ids[slot] = rid
        self.slot_of[rid] = slot
