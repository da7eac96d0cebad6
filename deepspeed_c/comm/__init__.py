"""deepspeed_c.comm: DeepSpeed's `deepspeed.comm` over torch.distributed, with the comms logger.

    import deepspeed_c.comm as dist
    dist.init_distributed()
    dist.all_reduce(t)
    dist.log_summary()
"""
from deepspeed_c.comm.constants import *  # noqa: F401,F403
from deepspeed_c.comm.reduce_op import ReduceOp
from deepspeed_c.comm.utils import (get_caller_func, get_local_rank_from_launcher, get_world_rank_from_launcher,
                                    get_world_size_from_launcher)
from deepspeed_c.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig
from deepspeed_c.comm.comms_logging import CommsLogger, calc_bw_log, convert_size
from deepspeed_c.comm.backend import TorchBackend
from deepspeed_c.comm.comm import *  # noqa: F401,F403
from deepspeed_c.comm.comm import comms_logger
from deepspeed_c.comm.bootstrap import default_backend, init_distributed, mpi_discovery
from torch.distributed import GradBucket, ProcessGroup  # noqa: F401  (DeepSpeed re-exports these)


def __getattr__(name: str):
    # `cdb` changes when the group comes up; always answer with the current backend object
    if name == "cdb":
        from deepspeed_c.comm import comm as _comm

        return _comm.cdb
    raise AttributeError(f"module 'deepspeed_c.comm' has no attribute {name!r}")
