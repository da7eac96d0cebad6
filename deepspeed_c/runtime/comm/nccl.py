"""DeepSpeed's `NcclBackend` name for the compressed all-reduce (comm_backend_name "nccl"). Here
it is the torch.distributed implementation of compressed.py, on whatever backend the process group
has (NCCL on GPUs, gloo on CPU ranks), with the sign codec in C/CUDA instead of cupy."""
from __future__ import annotations

from deepspeed_c.runtime.comm.compressed import CompressedBackend


class NcclBackend(CompressedBackend):
    """comm_backend_name "nccl"."""
