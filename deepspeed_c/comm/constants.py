"""Names and defaults of deepspeed.comm: backend names, the comms_logger config keys, the
default port and process-group timeout."""
from __future__ import annotations

import os
from datetime import timedelta

NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
DEEPSPEED_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"
DEFAULT_TIMEOUT_MINUTES = 30


def timeout_from_env() -> timedelta:
    """The process-group timeout: DEEPSPEED_TIMEOUT minutes, else 30 (DeepSpeed's default)."""
    raw = os.getenv(DEEPSPEED_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
    try:
        minutes = float(raw)
    except ValueError:
        raise ValueError(f"{DEEPSPEED_TIMEOUT_ENV} must be a number of minutes, got {raw!r}") from None
    if minutes <= 0:
        raise ValueError(f"{DEEPSPEED_TIMEOUT_ENV} must be positive, got {raw!r}")
    return timedelta(minutes=minutes)


# Read once at import, as DeepSpeed does; init_distributed re-reads the variable when it is
# handed this very object, so setting DEEPSPEED_TIMEOUT after import still takes effect.
default_pg_timeout = timeout_from_env()

COMMS_LOGGER_FORMAT = '''
The Comms Logger can be specified as:
"comms_logger": {
  "enabled": true,
  "verbose": false,
  "prof_all": true,
  "debug": false,
  "prof_ops": ["all_reduce", "custom_all_reduce_name"]
}
'''
COMMS_LOGGER = "comms_logger"
COMMS_LOGGER_ENABLED = "enabled"
COMMS_LOGGER_ENABLED_DEFAULT = False
COMMS_LOGGER_VERBOSE = "verbose"
COMMS_LOGGER_VERBOSE_DEFAULT = False
COMMS_LOGGER_PROF_ALL = "prof_all"
COMMS_LOGGER_PROF_ALL_DEFAULT = True
COMMS_LOGGER_DEBUG = "debug"
COMMS_LOGGER_DEBUG_DEFAULT = False
COMMS_LOGGER_PROF_OPS = "prof_ops"
COMMS_LOGGER_PROF_OPS_DEFAULT: list[str] = []

__all__ = [n for n in dir() if n.isupper()] + ["default_pg_timeout", "timeout_from_env"]
