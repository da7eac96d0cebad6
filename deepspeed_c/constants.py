"""DeepSpeed's `deepspeed.constants`."""
from deepspeed_c.comm.constants import default_pg_timeout  # noqa: F401

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
