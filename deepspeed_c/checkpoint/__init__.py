from deepspeed_c._lazy import lazy_exports as _lazy_exports
from deepspeed_c.checkpoint.constants import *  # noqa: F401,F403 (DeepSpeed's key names: plain strings, cheap)

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {
    "DeepSpeedCheckpoint": "deepspeed_c.checkpoint.deepspeed_checkpoint:DeepSpeedCheckpoint",
    "get_model_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_zero_ckpt_name_for_rank",
    "get_layer_ckpt_name_for_rank": "deepspeed_c.checkpoint.utils:get_layer_ckpt_name_for_rank",
    "reshape_meg_2d_parallel": "deepspeed_c.checkpoint.reshape_meg_2d:reshape_meg_2d_parallel",
    "merge_state": "deepspeed_c.checkpoint.reshape_utils:merge_state",
    "model_3d_desc": "deepspeed_c.checkpoint.reshape_3d_utils:model_3d_desc",
    "get_model_3d_descriptor": "deepspeed_c.checkpoint.reshape_3d_utils:get_model_3d_descriptor",
    "ZeROCheckpoint": "deepspeed_c.checkpoint.zero_checkpoint:ZeROCheckpoint",
    "enable_universal_checkpoint": "deepspeed_c.checkpoint.universal_checkpoint:enable_universal_checkpoint",
    "SubparamShape": "deepspeed_c.checkpoint.universal_checkpoint:SubparamShape",
})
