"""Compressed collectives for the 1-bit optimizers (DeepSpeed's deepspeed.runtime.comm): the
two-phase sign all-reduce with error feedback (compressed.py) over torch.distributed, and the
backends the optimizers' `comm_backend_name` picks (nccl.py, compressed.py, mpi.py)."""
