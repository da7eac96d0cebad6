"""deepspeed.module_inject: AutoTP -- tensor-parallel Linear layers (`layers`) and their detection (`auto_tp`)."""
from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode  # noqa: F401
