"""Names of DeepSpeed's deepspeed.checkpoint.universal_checkpoint. SubparamShape describes a fused parameter
made of sub-parameters (AutoTP's sub_param_shape). enable_universal_checkpoint is how DeepSpeed's own
optimizers attach a per-parameter universal loader to their low-precision parameters; deepspeed_c loads a
universal folder through the engine instead (checkpoint.load_universal, runtime/checkpointing/universal_load.py),
so the attached method says so when called."""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Iterable, List, Tuple, Union


@dataclass
class SubparamShape:
    patterns: List[str]
    shape: Tuple[Union[Tuple[int], int]]
    partition_dim: int


def _load_hp_checkpoint_state(param: Any, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0,
                              ep_size: int = 1) -> Any:
    raise NotImplementedError(
        f"load_hp_checkpoint_state({folder!r}): deepspeed_c's optimizers keep no per-parameter high-precision "
        "mapping to fill; load a universal checkpoint with engine.load_checkpoint and "
        '"checkpoint": {"load_universal": true} in the config')


def enable_universal_checkpoint(param_list: Iterable[Any]) -> None:
    """Attaches `load_hp_checkpoint_state` to each parameter, as DeepSpeed does (see the module note)."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(_load_hp_checkpoint_state, param)
