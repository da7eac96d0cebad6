"""AutoTP's check of the first forward's inputs: every rank of a tensor-parallel group must run the same batch
(their shards only sum to the model's output over the same tokens). A data loader that splits batches over every
rank instead of over the data-parallel ones would train on mixed-up activations without an error; DeepSpeed
asserts on the first forward, and so does this (the same AssertionError text)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from deepspeed_c.utils.logging import logger

MESSAGE = "Data inconsistency within the TP group. Please check the Dataloader implementation to ensure consistency."


def _leaves(args: Any, kwargs: Any) -> list:
    leaves, _ = tree_flatten((args, kwargs))
    return [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in leaves]


def _same(mine: list, src: list) -> bool:
    if len(mine) != len(src):
        return False
    for a, b in zip(mine, src):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and torch.equal(a, b)):
                return False
        elif type(a) is not type(b) or (a != b and not (a is None and b is None)):
            return False
    return True


def check_same_inputs(args: Any, kwargs: Any, group: Any, src: int) -> None:
    """Collective over the tensor-parallel group: raises AssertionError on every rank when any rank's inputs
    differ from the group's first rank's."""
    import deepspeed_c.comm as dist

    mine = _leaves(args, kwargs)
    box = [mine if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    differ = torch.tensor([0 if _same(mine, box[0]) else 1], dtype=torch.int64)
    dist.all_reduce(differ, group=group)
    if int(differ.item()):
        raise AssertionError(f"{MESSAGE} ({int(differ.item())} rank(s) of the tensor-parallel group received "
                             f"other inputs than rank {src})")
    logger.info(":The Dataloader has passed the TP group consistency check.")


def install(module: torch.nn.Module, group: Any, src: int) -> Any:
    """A forward pre-hook on `module` that checks its first call's inputs and removes itself; returns its handle."""
    state: dict = {}

    def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        state["handle"].remove()
        check_same_inputs(args, kwargs, group, src)

    state["handle"] = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    return state["handle"]


def first_forward_check(module: torch.nn.Module, dims: Any, mpu: Any) -> Any:
    """The engine's `first_dataloader_check` (DeepSpeed's name): the hook's handle under AutoTP sharding, else None."""
    if not dims.autotp_sharded:
        return None
    return install(module, mpu.get_model_parallel_group(), mpu.get_tensor_model_parallel_src_rank())
