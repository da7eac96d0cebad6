from deepspeed_c.accelerator.abstract_accelerator import DeepSpeedAccelerator  # noqa: F401
from deepspeed_c.accelerator.real_accelerator import (  # noqa: F401
    get_accelerator, is_current_accelerator_supported, set_accelerator)
