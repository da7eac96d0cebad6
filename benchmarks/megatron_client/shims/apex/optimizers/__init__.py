"""apex.optimizers stand-ins (import only: the runs pass --ds_fused_adam, so each DeepSpeed's FusedAdam is used)."""
import torch


class FusedAdam(torch.optim.AdamW):
    pass


class FusedSGD(torch.optim.SGD):
    pass
