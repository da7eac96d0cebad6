"""DeepSpeed's deepspeed.runtime.checkpoint_engine: the object the engine hands every checkpoint file to
(engine.checkpoint_engine). The built-in engines name deepspeed_c's writers (checkpoint/store.py's crash-safe
files, runtime/checkpointing/async_writer.py's background writer); a user's CheckpointEngine subclass set on
the engine gets DeepSpeed's hooks (makedirs, create, save, commit, load) for every file."""
from deepspeed_c._lazy import lazy_exports as _lazy_exports

__getattr__, __dir__ = _lazy_exports(__name__, {
    "FastCheckpointEngine": "deepspeed_c.runtime.checkpoint_engine.fast_checkpoint_engine:FastCheckpointEngine",
    "TorchCheckpointEngine": "deepspeed_c.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine",
    "DecoupledCheckpointEngine":
        "deepspeed_c.runtime.checkpoint_engine.decoupled_checkpoint_engine:DecoupledCheckpointEngine",
    "CheckpointCommitInfo": "deepspeed_c.runtime.checkpoint_engine.checkpoint_engine:CheckpointCommitInfo",
    "DataStatesCheckpointEngine":
        "deepspeed_c.runtime.checkpoint_engine.datastates_checkpoint_engine:DataStatesCheckpointEngine",
    "create_checkpoint_engine": "deepspeed_c.runtime.checkpoint_engine.utils:create_checkpoint_engine",
})
