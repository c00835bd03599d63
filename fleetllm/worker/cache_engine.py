"""The paged KV cache of one worker: a device pool and a CPU swap pool of fixed-size blocks."""

from __future__ import annotations

import torch

from fleetllm.config import EngineConfig
from fleetllm.model import huge_pages


def kv_block_shape(config: EngineConfig, num_blocks: int, num_kv_heads: int, head_dim: int
                   ) -> tuple[int, ...]:
    return (2, num_blocks, config.cache_config.block_size, num_kv_heads, head_dim)


class CacheEngine:
    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_gpu_blocks: int,
                 num_cpu_blocks: int):
        self.device = device
        # What wake_up needs to build the same pools again after sleep() dropped them.
        self.args = (num_layers, num_kv_heads, head_dim, dtype, device, num_gpu_blocks,
                     num_cpu_blocks)
        pin = device.type == "cuda"
        shape = kv_block_shape(config, num_gpu_blocks, num_kv_heads, head_dim)
        # On the CPU in huge pages: a decode step's attention reads blocks all over the cache.
        self.gpu_cache = [huge_pages.zeros(shape, dtype) if device.type == "cpu"
                          else torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(num_layers)]
        self.cpu_cache = [torch.zeros(kv_block_shape(config, num_cpu_blocks, num_kv_heads,
                                                     head_dim), dtype=dtype, pin_memory=pin)
                          for _ in range(num_layers)]

    @staticmethod
    def block_bytes(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
        per_layer = 2 * config.cache_config.block_size * num_kv_heads * head_dim
        return per_layer * num_layers * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        """Bytes held by both pools (what sleep() gives back)."""
        return sum(t.numel() * t.element_size() for t in (*self.gpu_cache, *self.cpu_cache))

    def swap_out(self, mapping: dict[int, int]) -> None:
        """Device blocks -> CPU blocks ({device block: cpu block})."""
        if mapping:
            src, dst = _index(mapping.keys()), _index(mapping.values())
            for gpu, cpu in zip(self.gpu_cache, self.cpu_cache, strict=True):
                cpu[:, dst] = gpu[:, src.to(self.device)].to("cpu")

    def swap_in(self, mapping: dict[int, int]) -> None:
        """CPU blocks -> device blocks ({cpu block: device block})."""
        if mapping:
            src, dst = _index(mapping.keys()), _index(mapping.values())
            for gpu, cpu in zip(self.gpu_cache, self.cpu_cache, strict=True):
                gpu[:, dst.to(self.device)] = cpu[:, src].to(self.device)

    def copy(self, mapping: dict[int, list[int]]) -> None:
        """Copy-on-write: {source block: [destination blocks]} on the device."""
        if mapping:
            pairs = [(s, d) for s, dsts in mapping.items() for d in dsts]
            src = _index(p[0] for p in pairs).to(self.device)
            dst = _index(p[1] for p in pairs).to(self.device)
            for gpu in self.gpu_cache:
                gpu[:, dst] = gpu[:, src]


def _index(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)
