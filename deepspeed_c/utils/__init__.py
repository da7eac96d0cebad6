"""deepspeed_c.utils: logger, data loading helpers, partitioned-state accessors."""
from deepspeed_c._lazy import lazy_exports
from deepspeed_c.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string  # noqa: F401
# eager, as in DeepSpeed: the function z3_leaf_module shadows its module's name on this package
from deepspeed_c.utils.z3_leaf_module import (  # noqa: F401
    get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__getattr__, __dir__ = lazy_exports(__name__, {
    "RepeatingLoader": "deepspeed_c.runtime.dataloader:RepeatingLoader",
    "groups": "deepspeed_c.utils.groups",
    "instrument_w_nvtx": "deepspeed_c.utils.nvtx:instrument_w_nvtx",
    "recursive_getattr": "deepspeed_c.utils.module_utils:recursive_getattr",
    "recursive_setattr": "deepspeed_c.utils.module_utils:recursive_setattr",
    "OnDevice": "deepspeed_c.utils.init_on_device:OnDevice",
    "zero_to_fp32": "deepspeed_c.utils.zero_to_fp32",
    "safe_get_full_fp32_param": "deepspeed_c.utils.tensor_fragment:safe_get_full_fp32_param",
    "safe_get_full_grad": "deepspeed_c.utils.tensor_fragment:safe_get_full_grad",
    "safe_get_full_optimizer_state": "deepspeed_c.utils.tensor_fragment:safe_get_full_optimizer_state",
    "safe_set_full_fp32_param": "deepspeed_c.utils.tensor_fragment:safe_set_full_fp32_param",
    "safe_set_full_optimizer_state": "deepspeed_c.utils.tensor_fragment:safe_set_full_optimizer_state",
    "safe_set_full_grad": "deepspeed_c.utils.tensor_fragment:safe_set_full_grad",
    "safe_get_local_fp32_param": "deepspeed_c.utils.tensor_fragment:safe_get_local_fp32_param",
    "safe_get_local_grad": "deepspeed_c.utils.tensor_fragment:safe_get_local_grad",
    "safe_get_local_optimizer_state": "deepspeed_c.utils.tensor_fragment:safe_get_local_optimizer_state",
    "safe_set_local_fp32_param": "deepspeed_c.utils.tensor_fragment:safe_set_local_fp32_param",
    "safe_set_local_optimizer_state": "deepspeed_c.utils.tensor_fragment:safe_set_local_optimizer_state",
    "safe_set_local_grad": "deepspeed_c.utils.tensor_fragment:safe_set_local_grad",
    "safe_update_full_grad_vectorized": "deepspeed_c.utils.tensor_fragment:safe_update_full_grad_vectorized",
})
