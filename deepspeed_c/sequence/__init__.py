"""deepspeed.sequence: sequence parallelism (DeepSpeed-Ulysses) -- `layer.DistributedAttention`."""
