"""The `sparse_attention` config section (DeepSpeed 0.19.6's keys and defaults; 0.19.8 dropped
the section, our version policy keeps it). The engine parses it into a plain dict
(`DeepSpeedConfig.sparse_attention`, None when absent), as DeepSpeed did, and
`sparsity_config_from_dict` turns that dict into the SparsityConfig a model builds its
SparseSelfAttention layers from."""
from __future__ import annotations

from typing import Any

from .sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                              FixedSparsityConfig, SparsityConfig, VariableSparsityConfig)

SECTION = "sparse_attention"
DEFAULTS: dict[str, Any] = {
    "block": 16, "different_layout_per_head": False, "num_local_blocks": 4, "num_global_blocks": 1,
    "attention": "bidirectional", "horizontal_global_attention": False, "num_different_global_patterns": 1,
    "num_random_blocks": 0, "local_window_blocks": [4], "global_block_indices": [0],
    "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}
# Each mode's keys, in DeepSpeed's order (the parsed dict holds exactly these plus "mode").
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices"),
}
_CLASSES = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
            "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig}
_ALL_KEYS = {"mode", *DEFAULTS}


def parse_sparse_attention(raw: Any) -> dict[str, Any] | None:
    """The section as DeepSpeed's get_sparse_attention returned it: {"mode": ..., the mode's keys
    with defaults filled}. Unknown keys and bad values raise naming `sparse_attention.<key>`; keys
    of another mode are accepted and ignored, as DeepSpeed did."""
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError, unknown_key_error

    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DeepSpeedConfigError(f"Config key '{SECTION}' must be a dict, got {type(raw).__name__}")
    for key in raw:
        if key not in _ALL_KEYS:
            raise unknown_key_error(SECTION, key, _ALL_KEYS)
    mode = raw.get("mode", "fixed")
    if mode not in MODE_KEYS:
        # DeepSpeed raised NotImplementedError for an unknown mode
        raise NotImplementedError(f"Config key '{SECTION}.mode': sparsity mode {mode!r} is not one of "
                                  f"{', '.join(MODE_KEYS)}")
    out: dict[str, Any] = {"mode": mode}
    for key in MODE_KEYS[mode]:
        value = raw.get(key, DEFAULTS[key])
        _check_value(key, value)
        out[key] = value
    return out


def _check_value(key: str, value: Any) -> None:
    from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

    def bad(expected: str) -> DeepSpeedConfigError:
        return DeepSpeedConfigError(f"Invalid value {value!r} for config key '{SECTION}.{key}': expected {expected}")

    default = DEFAULTS[key]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
    elif isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key != "num_random_blocks" else 0):
            raise bad("a positive int" if key != "num_random_blocks" else "an int >= 0")
    elif key == "attention":
        if value not in ("unidirectional", "bidirectional"):
            raise bad("'unidirectional' or 'bidirectional'")
    elif key in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
        if value is None and key == "global_block_end_indices":
            return
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise bad("a list of ints")


def sparsity_config_from_dict(sparse_attention: dict[str, Any], num_heads: int) -> SparsityConfig:
    """The SparsityConfig a parsed `sparse_attention` dict describes, for a layer of num_heads heads."""
    parsed = parse_sparse_attention(sparse_attention)
    mode = parsed.pop("mode")
    return _CLASSES[mode](num_heads=num_heads, **parsed)
