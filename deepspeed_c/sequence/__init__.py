"""deepspeed.sequence: sequence parallelism -- `layer.DistributedAttention` (DeepSpeed-Ulysses) and
`fpdt_layer` (FPDT / Ulysses-Offload: chunked, host-offloaded Ulysses attention, FFN and logits loss)."""
