"""Model parallelism a client brings (Megatron-style layers plus an `mpu`): the mpu protocol read once
into plain values (mpu_protocol.py), and the whole model's gradient norm over the tensor-parallel group
(tp_norm.py)."""
