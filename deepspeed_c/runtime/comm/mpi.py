"""DeepSpeed's `MpiBackend` (comm_backend_name "mpi"). DeepSpeed moves the compressed chunks with
mpi4py; deepspeed_c keeps torch.distributed as its only transport, so this backend asks for mpi4py
as DeepSpeed does (a config naming "mpi" on a machine without it fails the same way) and then
runs the same collectives as "nccl"."""
from __future__ import annotations

from typing import Any

from deepspeed_c.runtime.comm.compressed import CompressedBackend


class MpiBackend(CompressedBackend):
    def __init__(self, cuda_aware: bool = False, mpu: Any = None) -> None:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            from deepspeed_c.runtime.config.utils import DeepSpeedConfigError

            raise DeepSpeedConfigError(
                "optimizer.params.comm_backend_name 'mpi' needs mpi4py, which is not installed; install it or use "
                "comm_backend_name 'nccl' (torch.distributed collectives)") from None
        self.cuda_aware = cuda_aware
        super().__init__(mpu)
