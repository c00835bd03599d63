"""Worker: one rank. Owns the device, this rank's model shard and its KV cache.

The model runner follows the task: ModelRunner generates; a pooling model (task "embed") gets
an EmbeddingModelRunner and no KV cache (its prompts run whole, one step each): the block
counts it reports only bound how many prompts the scheduler admits at once.

With a KV connector (kv_transfer_config), each step loads the blocks the scheduler planned
(every layer, before the forward: the fused layers have no per-layer hook) and saves after it;
every rank, output rank or not, returns its KVConnectorOutput (failed loads) on the step's
last SamplerOutput."""

from __future__ import annotations

import ctypes
import functools
import gc
import math
import os
import resource
from typing import Any

import torch

from fleetllm.config import EngineConfig, GiB
from fleetllm.distributed import parallel_state
from fleetllm.errors import ConfigurationError, EngineSleepingError, OutOfMemoryError
from fleetllm.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from fleetllm.kv_transfer.factory import create_connector
from fleetllm.lora.request import LoRARequest
from fleetllm.model import fused
from fleetllm.sequence import ExecuteModelRequest, KVConnectorOutput, SamplerOutput
from fleetllm.worker.cache_engine import CacheEngine
from fleetllm.worker.embedding_model_runner import EmbeddingModelRunner
from fleetllm.worker.model_runner import ModelRunner
from fleetllm.worker.worker_base import WorkerBase

CPU_DEFAULT_KV_CACHE = 2 * GiB


class Worker(WorkerBase):
    def __init__(self, config: EngineConfig, local_rank: int = 0, rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True):
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.model_runner: ModelRunner | None = None
        self.cache_engine: CacheEngine | None = None
        self.kv_connector: KVConnectorBase_V1 | None = None

    def init_device(self) -> None:
        device = self.config.device_config.device
        if device == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(self.config.model_config.seed)
        pc = self.config.parallel_config
        parallel_state.init_distributed(pc.world_size, self.rank, self.distributed_init_method,
                                        pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                        device,
                                        enable_expert_parallel=pc.enable_expert_parallel)
        self.is_output_rank = self.rank == parallel_state.output_rank(
            pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def load_model(self) -> None:
        runner = EmbeddingModelRunner if self.config.model_config.is_pooling else ModelRunner
        self.model_runner = runner(self.config, self.device, self.is_output_rank)
        self.model_runner.load_model()

    def _kv_shape(self) -> tuple[int, int, int]:
        """(layers on this rank, KV heads on this rank, head_dim)."""
        attn = next(iter(self.model_runner.model.layers.values())).self_attn
        return len(self.model_runner.model.layers), attn.num_kv_heads, attn.head_dim

    def _kv_dtype(self) -> torch.dtype:
        return self.config.cache_config.torch_kv_dtype(self.model_runner.dtype)

    def determine_num_available_blocks(self) -> tuple[int, int]:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        # More than max_num_seqs full-length sequences can never be used: don't allocate it.
        per_seq = math.ceil(sc.max_model_len / cc.block_size)
        usable = sc.max_num_seqs * per_seq + 1
        if self.config.model_config.is_pooling:  # bookkeeping only: nothing is allocated
            return usable, 0
        if self.device.type == "cuda":  # measure the profile run's peak alone
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        before = _peak_bytes(self.device)
        self.model_runner.profile_run()
        activation_peak = max(0, _peak_bytes(self.device) - before)
        # The profile's peak is in activation_peak: its cached blocks (cuda) and the heap's
        # free pages (cpu: the trim threshold keeps them, ~0.5 GB for a 1B model) go back
        # until a step needs them; a worker that is only loaded holds weights and cache.
        _release_memory(self.device)
        block_bytes = CacheEngine.block_bytes(self.config, *self._kv_shape(), self._kv_dtype())
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cc.gpu_memory_utilization - (total - free) - activation_peak
        elif cc.kv_cache_memory is None:
            budget = CPU_DEFAULT_KV_CACHE
        elif cc.kv_cache_memory > 1:
            budget = cc.kv_cache_memory
        else:
            budget = cc.kv_cache_memory * _available_ram() - activation_peak
        num_gpu = min(cc.num_gpu_blocks_override or int(max(0, budget) // block_bytes), usable)
        if cc.num_gpu_blocks_override is None and num_gpu < per_seq:
            raise OutOfMemoryError(
                f"rank {self.rank}: the KV cache budget of {max(0, budget) / GiB:.3f} GiB holds "
                f"{num_gpu} blocks of {block_bytes} bytes, fewer than the {per_seq} blocks one "
                f"sequence of max_model_len={sc.max_model_len} needs. Raise kv_cache_memory / "
                "gpu_memory_utilization, or reduce max_model_len or max_num_batched_tokens.")
        num_cpu = min(int(cc.swap_space // block_bytes), usable)
        gc.collect()
        return num_gpu, num_cpu

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = None  # free the old pools first when re-initializing
        if self.config.model_config.is_pooling:
            return
        self.cache_engine = CacheEngine(self.config, *self._kv_shape(), self._kv_dtype(),
                                        self.device, num_gpu_blocks, num_cpu_blocks)
        self._register_kv_caches()

    def _register_kv_caches(self) -> None:
        if self.config.kv_transfer_config is None:
            return
        if self.kv_connector is None:
            self.kv_connector = create_connector(self.config, KVConnectorRole.WORKER, self.rank)
        self.kv_connector.register_kv_caches(self.cache_engine.gpu_cache)

    def execute_model(self, execute_model_req: ExecuteModelRequest,
                      drafts: dict[int, list[int]] | None = None) -> list[SamplerOutput] | None:
        """One step. drafts: speculative decoding's draft tokens per decoding sequence (the
        SpecDecodeWorker that wraps this worker passes them), scored in the same forward."""
        req = execute_model_req
        if self.config.model_config.is_pooling:
            output = self.model_runner.execute_model(req, None)
            return None if output is None else [output]
        cache = self.cache_engine
        if cache is None:
            raise RuntimeError("execute_model before initialize_cache")
        cache.swap_out(req.blocks_to_swap_out)
        cache.swap_in(req.blocks_to_swap_in)
        cache.copy(req.blocks_to_copy)
        connector = self.kv_connector
        if connector is None:
            return self.model_runner.execute_model(req, cache.gpu_cache, drafts)
        connector.bind_connector_metadata(req.kv_connector_metadata)
        try:
            connector.start_load_kv()
            connector.wait_for_layer_load(None)
            output = self.model_runner.execute_model(req, cache.gpu_cache, drafts)
            connector.save_kv_layer(None)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        sending, recving = connector.get_finished(set(req.finished_requests_ids))
        kv_output = KVConnectorOutput(sending, recving,
                                      connector.get_block_ids_with_load_errors(),
                                      connector.get_kv_connector_stats())
        if output is None:  # not the output rank: the executor still needs its news
            output = [SamplerOutput([])]
        output[-1].kv_connector_output = kv_output
        return output

    # ------------------------------------------------------------ LoRA adapters (vLLM's names)

    def _loras(self):
        manager = self.model_runner.lora_manager if self.model_runner else None
        if manager is None:
            raise ConfigurationError("enable_lora: LoRA adapters need enable_lora=True")
        return manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter (this rank's shards) into the host-memory LRU."""
        return self._loras().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._loras().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._loras().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._loras().list()

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.model is None:
            raise RuntimeError(f"rank {self.rank}: no model loaded")
        # A small operation on the device: a wedged or lost device fails or hangs here.
        if torch.ones(2, device=self.device).sum().item() != 2:
            raise RuntimeError(f"rank {self.rank}: the device computes wrong results")

    def shutdown(self) -> None:
        self.cache_engine = None
        self.model_runner = None
        if self.config.parallel_config.world_size > 1:
            parallel_state.destroy_distributed()

    # ------------------------------------------------------------ sleep / wake (lifecycle)

    def _sleep_state(self) -> dict[str, Any]:
        """What sleep() took away, by tag: "kv_cache" -> CacheEngine.args to rebuild it;
        "weights" -> "offloaded" (moved to host memory) or the emptied model (discarded)."""
        return self.__dict__.setdefault("_asleep", {})

    def sleep(self, level: int = 1) -> int:
        """Free this rank's KV cache (level 1; on CUDA the weights also move to host memory),
        or the KV cache and the weights (level 2; wake_up reloads them from the checkpoint).
        Model buffers (RoPE tables) are kept. Returns the bytes freed; freeing what is
        already asleep is a no-op."""
        if level not in (1, 2):
            raise ConfigurationError(f"level: sleep level must be 1 or 2, got {level!r}")
        state = self._sleep_state()
        freed = 0
        if self.cache_engine is not None:
            state["kv_cache"] = self.cache_engine.args
            freed += self.cache_engine.nbytes()
            self.cache_engine = None
        model = self.model_runner.model
        if "weights" not in state and (level == 2 or self.device.type != "cpu"):
            freed += sum(p.numel() * p.element_size() for p in model.parameters())
            if level == 1:  # only an accelerator has something to gain from this
                model.to("cpu")
                state["weights"] = "offloaded"
            else:
                # Parameters only: buffers are not in the checkpoint, so they stay (vLLM lost
                # them, #16889, and answered gibberish after waking). Tied parameters are
                # one object, emptied once.
                for param in model.parameters():
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                held = {id(getattr(getattr(m, "kernel", None), "tensor", None))
                        for m in model.modules()}
                for module in model.modules():  # the kernels' packed copies go too
                    kernel = getattr(module, "kernel", None)
                    if kernel is not None:
                        # an MoE layer's experts' kernel is a function: its weights are its
                        # parameters, or `packed` (a GGUF file's, below)
                        freed += getattr(kernel, "nbytes", 0)
                        module.kernel = None
                    # A GGUF embedding's quantized rows (a tied LM head's kernel shares them:
                    # counted there)
                    packed = module.__dict__.pop("packed", None)
                    if packed is not None and id(packed) not in held:
                        freed += packed.numel()
                fused.forget(model)  # it holds the packed copies for the one-call layers
                state["weights"] = model
        _release_memory(self.device)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep() freed: "weights", "kv_cache" or both (None). The KV cache comes
        back with the same number of blocks (empty: no request may span a sleep); discarded
        weights are loaded again as configured (load_format). Waking what is awake: no-op."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ConfigurationError(f"tags: {sorted(unknown)} are not 'weights' or "
                                     "'kv_cache'")
        state = self._sleep_state()
        if "weights" in tags and "weights" in state:
            old = state.pop("weights")
            if old == "offloaded":
                self.model_runner.model.to(self.device)
            else:  # the standard load path, so the weights are exactly those of the start
                self.model_runner.load_model()
                kept = dict(old.named_buffers())
                for name, buf in self.model_runner.model.named_buffers():
                    if name in kept and kept[name].shape == buf.shape:
                        buf.copy_(kept[name])
                del old, kept
                _release_memory(self.device)
        if "kv_cache" in tags and "kv_cache" in state:
            self.cache_engine = CacheEngine(self.config, *state.pop("kv_cache"))
            self._register_kv_caches()

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> list[str]:
        """Write this rank's tensors under `path` (see fleetllm.model.sharded_state); rank 0
        also copies the checkpoint's config and tokenizer files. Returns the file names."""
        from fleetllm.model.sharded_state import copy_model_files, save_sharded_state

        if "weights" in self._sleep_state():
            raise EngineSleepingError("save_sharded_state: the weights are asleep; "
                                      "wake_up(['weights']) first")
        files = save_sharded_state(self.model_runner.model, path, self.rank, pattern, max_size)
        if self.rank == 0:
            copy_model_files(self.config.model_config, path)
        return files


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _release_memory(device: torch.device) -> None:
    """Hand freed memory back to the device / the OS, so that sleeping lowers the footprint.

    CPU tensors come from glibc malloc: large ones (over M_MMAP_THRESHOLD, which glibc raises
    up to 32 MiB as big blocks are freed) are mmap'd and unmapped when freed; smaller ones sit
    in the heap, where only malloc_trim returns their free pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None
