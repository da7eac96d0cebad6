"""partition_activations with a model-parallel mpu (runtime/activation_checkpointing/partition.py), 2 gloo
and 4 gloo ranks, each world one model-parallel group: two checkpointed segments with dropout, an input whose size does not
divide by 2, a non-float tensor and a non-tensor argument. With partitioning (alone, with cpu_checkpointing,
with contiguous_memory_optimization) outputs and gradients equal the unpartitioned run bit for bit, and each
rank saves 1/world of the activation elements (counted through saved-tensor hooks). More segments waiting for
backward than number_checkpoints is refused naming the key."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.harness import run_distributed


class _MPU:
    def __init__(self) -> None:
        import torch.distributed as dist

        self.size = dist.get_world_size()
        self.group = dist.new_group(list(range(self.size)))

    def get_model_parallel_group(self) -> Any:
        return self.group

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.size


def _segment(x: Any, w: Any, ids: Any, scale: float) -> Any:
    import torch

    h = torch.nn.functional.dropout(torch.tanh(x @ w) * scale, p=0.3, training=True)
    return h + ids.float().mean()


def _run(mode: str) -> dict[str, Any]:
    import torch

    import deepspeed_c

    ckpt = deepspeed_c.checkpointing
    kw = {"none": dict(partition_activations=False, contiguous_checkpointing=False, checkpoint_in_cpu=False),
          "partition": dict(partition_activations=True, contiguous_checkpointing=False, checkpoint_in_cpu=False),
          "cpu": dict(partition_activations=True, contiguous_checkpointing=False, checkpoint_in_cpu=True),
          "contiguous": dict(partition_activations=True, contiguous_checkpointing=True, checkpoint_in_cpu=False,
                             num_checkpoints=2)}[mode]
    ckpt.configure(_MPU(), **kw)
    torch.manual_seed(0)
    w1, w2 = torch.randn(7, 7, requires_grad=True), torch.randn(7, 7, requires_grad=True)
    saved = [0]

    def pack(t: Any) -> Any:
        if t.is_floating_point():
            saved[0] += t.numel()
        return t

    out: dict[str, Any] = {}
    for it in range(2):
        torch.manual_seed(10 + it)  # the same dropout masks on both model-parallel ranks
        x = torch.randn(5, 7, requires_grad=True)
        ids = torch.arange(4)
        saved[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = ckpt.checkpoint(_segment, x, w1, ids, 0.5)
            y = ckpt.checkpoint(_segment, h, w2, ids, 2.0)
        out[f"saved{it}"] = saved[0]
        (y ** 2).sum().backward()
        out[f"y{it}"] = y.detach().numpy().copy()
        out[f"gx{it}"] = x.grad.numpy().copy()
    out["gw1"], out["gw2"] = w1.grad.numpy().copy(), w2.grad.numpy().copy()
    if mode == "contiguous":  # three segments waiting for their backward, two slots
        x = torch.randn(5, 7, requires_grad=True)
        h = x
        try:
            for _ in range(3):
                h = ckpt.checkpoint(_segment, h, w1, ids, 1.0)
            out["overflow"] = "accepted"
        except RuntimeError as e:
            out["overflow"] = str(e)
    ckpt.configure(None, partition_activations=False, contiguous_checkpointing=False, checkpoint_in_cpu=False)
    return out


def body(rank: int, world: int) -> dict[str, Any]:
    return {mode: _run(mode) for mode in ("none", "partition", "cpu", "contiguous")}


@pytest.mark.parametrize("world", [2, 4])
def test_partitioned_checkpoints_equal_and_split_saved_activations(world: int) -> None:
    for res in run_distributed(body, world, timeout=180):
        base = res["none"]
        for mode in ("partition", "cpu", "contiguous"):
            got = res[mode]
            for key in ("y0", "gx0", "y1", "gx1", "gw1", "gw2"):
                np.testing.assert_array_equal(got[key], base[key], err_msg=f"{mode} {key}")
            # x, h (35 elements) and w1, w2 (49) are saved as slices of ceil(n / world): 1/world of them
            want = 2 * (-(-35 // world)) + 2 * (-(-49 // world))
            assert got["saved0"] == want and base["saved0"] == 2 * 35 + 2 * 49, (mode, got["saved0"], want)
        assert "number_checkpoints" in res["contiguous"]["overflow"]
