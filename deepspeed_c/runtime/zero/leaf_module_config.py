"""DeepSpeed's public path for the `zero_optimization.leaf_module` section (`deepspeed.runtime.zero.leaf_module_config`);
it lives in runtime/config/zero.py."""
from deepspeed_c.runtime.config.zero import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,  # noqa: F401
                                             DEFAULT_LEAF_MODULE_NAMES, DeepSpeedZeroLeafModuleConfig)

__all__ = ["DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
           "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
