"""deepspeed_c: DeepSpeed's training API with cores written in C.

`import deepspeed_c as deepspeed` in an existing DeepSpeed script. Importing is cheap: nothing is
built, no subprocess starts, CUDA and torch.distributed are not initialised; public names resolve
on first use.
"""
import os as _os

from deepspeed_c._lazy import lazy_exports
from deepspeed_c._torch_range import check_torch_version as _check_torch_version

_check_torch_version()  # a torch outside the supported range: one ImportError naming it (not a crash in C)
if _os.environ.get("DSC_CORE_DIR"):
    # a separately built core module (scripts/sanitize_tests.sh: the DSC_SANITIZE=1 `_C` in build/sanitize)
    # is found before the in-place one; every other submodule still comes from this folder
    __path__.insert(0, _os.environ["DSC_CORE_DIR"])
from deepspeed_c.version import (__git_branch__, __git_hash__, __version__, __version_major__, __version_minor__,
                                 __version_patch__)

__all__ = [
    "__version__", "__git_hash__", "__git_branch__", "initialize", "init_inference", "OnDevice", "DeepSpeedConfigError", "add_config_arguments", "init_distributed", "DeepSpeedEngine",
    "DeepSpeedConfig", "comm", "zero", "checkpointing", "ops", "utils", "accelerator",
]

__getattr__, __dir__ = lazy_exports(__name__, {
    # the engine issue fills these modules in
    "initialize": "deepspeed_c.runtime.initialize:initialize",
    "add_config_arguments": "deepspeed_c.runtime.initialize:add_config_arguments",
    "DeepSpeedEngine": "deepspeed_c.runtime.engine:DeepSpeedEngine",
    "DeepSpeedConfig": "deepspeed_c.runtime.config:DeepSpeedConfig",
    "init_distributed": "deepspeed_c.comm:init_distributed",
    "comm": "deepspeed_c.comm",
    "zero": "deepspeed_c.runtime.zero",
    "checkpointing": "deepspeed_c.runtime.activation_checkpointing.checkpointing",
    "ops": "deepspeed_c.ops",
    "utils": "deepspeed_c.utils",
    "accelerator": "deepspeed_c.accelerator",
    "get_accelerator": "deepspeed_c.accelerator:get_accelerator",
    "runtime": "deepspeed_c.runtime",
    "launcher": "deepspeed_c.launcher",
    "monitor": "deepspeed_c.monitor",
    "checkpoint": "deepspeed_c.checkpoint",
    "OnDevice": "deepspeed_c.utils.init_on_device:OnDevice",
    "DeepSpeedConfigError": "deepspeed_c.runtime.config.utils:DeepSpeedConfigError",
    "log_dist": "deepspeed_c.utils.logging:log_dist",
    "logger": "deepspeed_c.utils.logging:logger",
    "pipe": "deepspeed_c.pipe",
    "PipelineModule": "deepspeed_c.pipe:PipelineModule",
    "PipelineEngine": "deepspeed_c.runtime.pipe.engine:PipelineEngine",
    "DeepSpeedHybridEngine": "deepspeed_c.runtime.hybrid_engine:DeepSpeedHybridEngine",
    "tp_model_init": "deepspeed_c.runtime.tensor_parallel.autotp_setup:tp_model_init",
    "set_autotp_mode": "deepspeed_c.runtime.tensor_parallel.mode:set_autotp_mode",
    "module_inject": "deepspeed_c.module_inject",
    "sequence": "deepspeed_c.sequence",
    "init_inference": "deepspeed_c.inference.api:init_inference",
    "InferenceEngine": "deepspeed_c.inference.engine:InferenceEngine",
    "DeepSpeedInferenceConfig": "deepspeed_c.inference.config:DeepSpeedInferenceConfig",
    "inference": "deepspeed_c.inference",
    "DeepSpeedTransformerLayer": "deepspeed_c.ops.transformer:DeepSpeedTransformerLayer",
    "DeepSpeedTransformerConfig": "deepspeed_c.ops.transformer:DeepSpeedTransformerConfig",
})
