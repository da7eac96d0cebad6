from deepspeed_c.accelerator.abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from deepspeed_c.accelerator.real_accelerator import (  # noqa: F401
    get_accelerator, is_current_accelerator_supported, set_accelerator)

from deepspeed_c._lazy import lazy_exports as _lazy_exports

# submodules resolve on attribute access, as after DeepSpeed's eager imports
__getattr__, __dir__ = _lazy_exports(__name__, {})
