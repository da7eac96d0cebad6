from deepspeed_c._lazy import lazy_exports as _lazy_exports
from deepspeed_c.checkpoint.constants import *  # noqa: F401,F403 (DeepSpeed's key names: plain strings, cheap)

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {
    "DeepSpeedCheckpoint": "deepspeed_c.checkpoint.deepspeed_checkpoint:DeepSpeedCheckpoint",
    "get_model_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_zero_ckpt_name_for_rank",
    "get_layer_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_layer_ckpt_name_for_rank",
})
