"""vLLM's engine arguments fleetllm has no field for (VLLM_ARGS: ignored with a warning, or
refused unless they hold vLLM's default) and vLLM's older flat speculative arguments
(SPEC_FLAT_ARGS), so that vLLM scripts and command lines run unchanged or fail saying why.
EngineConfig.from_kwargs routes them; arg_utils makes CLI flags of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fleetllm.errors import ConfigurationError

logger = logging.getLogger("fleetllm.config")  # its name before config_vllm.py was split out


@dataclass(frozen=True)
class VllmArg:
    """A vLLM engine argument fleetllm has no field for, accepted so that vLLM scripts and
    command lines run unchanged, or refused with the reason."""

    default: Any  # vLLM's default ("off"); its type is also the CLI flag's
    note: str  # why it is ignored, or why it is not supported
    refuse: bool = False  # True: any value but `default` would change results: an error

    def accept(self, name: str, value: Any) -> None:
        if not self.refuse:
            logger.warning("%s=%r is accepted for vLLM compatibility and ignored: %s", name,
                           value, self.note)
        elif value != self.default:
            raise ConfigurationError(f"{name}: {value!r} is not supported: {self.note}")


# vLLM's older flat speculative arguments -> speculative_config keys.
SPEC_FLAT_ARGS = {"speculative_model": "model",
                  "num_speculative_tokens": "num_speculative_tokens",
                  "ngram_prompt_lookup_max": "prompt_lookup_max",
                  "ngram_prompt_lookup_min": "prompt_lookup_min"}

VLLM_ARGS: dict[str, VllmArg] = {
    # Tuning of machinery fleetllm does not have: the results are the same without it.
    "enforce_eager": VllmArg(False, "fleetllm has no CUDA graphs, it always runs eagerly"),
    "max_seq_len_to_capture": VllmArg(8192, "fleetllm has no CUDA graphs"),
    "max_context_len_to_capture": VllmArg(None, "fleetllm has no CUDA graphs"),
    "disable_custom_all_reduce": VllmArg(False, "fleetllm has no custom all-reduce"),
    "trust_remote_code": VllmArg(False, "fleetllm runs its own model code, never a "
                                        "checkpoint's"),
    "tokenizer_mode": VllmArg("auto", "the checkpoint's tokenizer is loaded with "
                                      "transformers' AutoTokenizer"),
    "disable_log_stats": VllmArg(False, "fleetllm has no stats logger"),
    "disable_log_requests": VllmArg(False, "fleetllm does not log requests"),
    "enable_chunked_prefill": VllmArg(None, "fleetllm always prefills in chunks of "
                                            "max_num_batched_tokens"),
    "use_v2_block_manager": VllmArg(True, "fleetllm has one block manager"),
    "disable_async_output_proc": VllmArg(False, "fleetllm processes outputs in step"),
    "download_dir": VllmArg(None, "fleetllm loads local directories and never downloads"),
    "disable_sliding_window": VllmArg(False, "max_model_len is capped at the sliding "
                                             "window either way"),
    # Features that change the results, which fleetllm does not implement: refused unless
    # they hold vLLM's default, which means what fleetllm does anyway.
    "observability_config": VllmArg(None, "fleetllm exports no traces (OpenTelemetry)",
                                    True),
    "fully_sharded_loras": VllmArg(False, "adapters are sharded as their base layers are"),
    "enable_prompt_adapter": VllmArg(False, "no prompt adapters in fleetllm", True),
    "rope_scaling": VllmArg(None, "rope scaling comes from the checkpoint's config.json",
                            True),
    "rope_theta": VllmArg(None, "rope_theta comes from the checkpoint's config.json", True),
    "hf_overrides": VllmArg(None, "the checkpoint's config.json is used as it is", True),
    "revision": VllmArg(None, "fleetllm loads a local directory as it is", True),
    "tokenizer_revision": VllmArg(None, "fleetllm loads a local directory as it is", True),
    "skip_tokenizer_init": VllmArg(False, "outputs always carry text when there is a "
                                          "tokenizer", True),
}
