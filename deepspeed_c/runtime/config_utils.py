"""`deepspeed.runtime.config_utils` (DeepSpeed's module path): the pydantic config base and its helpers live in
runtime/config/utils.py."""
from deepspeed_c.runtime.config.utils import *  # noqa: F401,F403
from deepspeed_c.runtime.config.utils import DeepSpeedConfigModel  # noqa: F401
