"""deepspeed.runtime.tensor_parallel: AutoTP training set-up (`tp_model_init`, the engine's (data, tensor) mpu)."""
from deepspeed_c.runtime.tensor_parallel.autotp_setup import (TensorParallelMPU, prepare_autotp,  # noqa: F401
                                                              tp_model_init)
from deepspeed_c.runtime.tensor_parallel.mode import AUTOTP_MODE  # noqa: F401
