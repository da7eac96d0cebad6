"""Op builders (DeepSpeed's `deepspeed.ops.op_builder`): one class per op; `load()` JIT-builds
and imports it. Also importable as `deepspeed_c.ops.op_builder`. Builder modules import each
other relatively, so both names work."""
from .builder import CPUOpBuilder, CUDAOpBuilder, OpBuildError, OpBuilder  # noqa: F401
from .all_ops import ALL_OPS, get_builder  # noqa: F401
from .all_ops import *  # noqa: F401,F403  (every builder class by its DeepSpeed name)
