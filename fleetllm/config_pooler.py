"""PoolerConfig (task "embed"): which vector stands for a prompt, read from the checkpoint.

First match wins: the user's `override_pooler_config`; a sentence-transformers checkpoint's
`modules.json` (its Pooling module names the mode, a Normalize module turns normalizing on,
`sentence_bert_config.json`'s `max_seq_length` caps the input); else LAST with normalize,
vLLM's default for decoder embedding models. A module fleetllm cannot apply (Dense, a max or
weighted-mean mode) is a ConfigurationError naming it, never skipped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.utils import dict_setting

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes -> our pooling types. Its Pooling config names the
# mode in "pooling_mode" (6.x) or with one flag per mode (older; none set means mean).
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean",
                    "pooling_mode_lasttoken": "lasttoken"}


@dataclass
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or \
                self.pooling_type.upper() not in POOLING_TYPES:
            raise ConfigurationError(f"pooling_type: must be one of {', '.join(POOLING_TYPES)}, "
                                     f"got {self.pooling_type!r}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ConfigurationError(f"normalize: must be True or False, got "
                                     f"{self.normalize!r}")

    @classmethod
    def from_override(cls, value: Any, base: PoolerConfig) -> PoolerConfig:
        """`override_pooler_config`: a PoolerConfig, a dict, or its JSON (the CLI flag); the
        fields it leaves out keep `base`'s values."""
        if isinstance(value, PoolerConfig):
            return value
        value = dict_setting("override_pooler_config", value,
                             "{'pooling_type': 'MEAN', 'normalize': False}")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ConfigurationError(f"override_pooler_config: unknown fields {sorted(unknown)}"
                                     "; fleetllm has pooling_type and normalize")
        return cls(value.get("pooling_type", base.pooling_type),
                   value.get("normalize", base.normalize))


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it as JSON: {e}") from e


def is_sentence_transformers(model_dir: Path) -> bool:
    return (model_dir / "modules.json").is_file()


def checkpoint_pooler(model_dir: Path) -> tuple[PoolerConfig, int | None]:
    """The checkpoint's pooler and the longest input its library embeds (None: no limit)."""
    if not is_sentence_transformers(model_dir):
        return PoolerConfig("LAST", True), None
    modules = _read(model_dir / "modules.json")
    if not isinstance(modules, list):
        raise ModelLoadError(f"{model_dir / 'modules.json'}: expected a list of modules")
    pooling: str | None = None
    normalize = False
    for module in modules:
        kind, sub = module.get("type", ""), module.get("path", "")
        # By class name: the library moved its modules (sentence_transformers.models.Pooling
        # before 6.0, ...sentence_transformer.modules.pooling.Pooling since).
        name = kind.rpartition(".")[2] if kind.startswith("sentence_transformers.") else kind
        if name == "Transformer":
            if sub not in ("", "."):
                raise ConfigurationError(f"{model_dir}: the transformer module lives in "
                                         f"{sub!r}; fleetllm loads the checkpoint's root")
        elif name == "Pooling":
            pooling = _st_pooling_mode(_read(model_dir / sub / "config.json"), model_dir / sub)
        elif name == "Normalize":
            normalize = True
        else:
            raise ConfigurationError(f"{model_dir}: sentence-transformers module {kind!r} "
                                     f"({sub or 'no path'}) is not supported; fleetllm "
                                     "applies Transformer, Pooling and Normalize modules only")
    if pooling is None:
        raise ConfigurationError(f"{model_dir / 'modules.json'} has no Pooling module")
    limit = None
    bert_cfg = model_dir / "sentence_bert_config.json"
    if bert_cfg.is_file():
        limit = _read(bert_cfg).get("max_seq_length")
    return PoolerConfig(pooling, normalize), limit if isinstance(limit, int) else None


def _st_pooling_mode(cfg: dict[str, Any], where: Path) -> str:
    mode = cfg.get("pooling_mode")
    if mode is None:
        mode = [m for flag, m in _ST_LEGACY_FLAGS.items() if cfg.get(flag)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ConfigurationError(
            f"{where}: pooling mode {modes if len(modes) > 1 else modes[0]!r} is not "
            f"supported; fleetllm pools with one of {', '.join(_ST_MODES)}")
    if cfg.get("include_prompt") is False:
        raise ConfigurationError(f"{where}: include_prompt=false (pooling that skips an "
                                 "instruction prompt) is not supported")
    return _ST_MODES[modes[0]]
