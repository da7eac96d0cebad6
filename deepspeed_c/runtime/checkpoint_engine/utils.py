"""create_checkpoint_engine: the engine for a parsed config, as DeepSpeed chooses it: checkpoint.writer ->
FastCheckpointEngine or (decoupled) DecoupledCheckpointEngine, else TorchCheckpointEngine. DeepSpeed's
`datastates_ckpt` section runs on deepspeed_c's decoupled writer (WriterConfig.from_datastates), so it
gives a DecoupledCheckpointEngine here unless the `datastates` package itself is installed."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine, config_value


def create_checkpoint_engine(config_params: Any, groups: Any = None, zero_stage: int = 0,
                             has_moe_layers: bool = False, optimize_dp_state: bool = False) -> CheckpointEngine:
    """groups, zero_stage, has_moe_layers: DeepSpeed's inputs for which ranks write (data_parallel); here
    the engine's checkpointer decides which rank writes which file, so every rank's engine writes."""
    from deepspeed_c.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
    from deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if config_params is None:
        return TorchCheckpointEngine(None)
    writer = config_value(config_params, "writer", None)
    if writer is not None:
        if bool(writer.get("decoupled", False)) if isinstance(writer, dict) else False:
            return DecoupledCheckpointEngine(config_params, None, optimize_dp_state)
        return FastCheckpointEngine(config_params, None, optimize_dp_state)
    datastates = (getattr(config_params, "user_dict", None) or {}).get("datastates_ckpt")
    if datastates not in (None, False):
        try:
            import datastates  # noqa: F401

            import torch.distributed as dist

            from deepspeed_c.runtime.checkpoint_engine.datastates_checkpoint_engine import DataStatesCheckpointEngine

            return DataStatesCheckpointEngine(config_params, dist.get_rank() if dist.is_initialized() else 0)
        except ImportError:
            return DecoupledCheckpointEngine(config_params, None, optimize_dp_state)
    return TorchCheckpointEngine(config_params)
