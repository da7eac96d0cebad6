"""Compressed Megatron layers (init_compression with an mpu) on 2 gloo ranks: a column-parallel then a
row-parallel linear, each shard's weight fake-quantized per shard and the row layer's rows pruned, against one
process computing the same shards' arithmetic with full matrices (forward and input gradient)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tests.harness import run_distributed

IN, MID, OUT = 8, 12, 6
CONFIG = {"compression_training": {
    "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True,
                                                  "quantize_groups": 2, "schedule_offset": 0},
                            "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4},
                                                       "modules": ["col", "row"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
                    "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["row"]}}}}}


class _Mpu:
    """The slice of Megatron's mpu that the compression library reads."""

    class ColumnParallelLinear(torch.nn.Module):
        def __init__(self, input_size: int, output_size: int, gather_output: bool = True) -> None:
            super().__init__()
            self.input_size, self.output_size, self.gather_output, self.skip_bias_add = input_size, output_size, \
                gather_output, False
            self.weight = torch.nn.Parameter(torch.empty(output_size // dist.get_world_size(), input_size))
            self.bias = torch.nn.Parameter(torch.empty(output_size // dist.get_world_size()))

    class RowParallelLinear(torch.nn.Module):
        def __init__(self, input_size: int, output_size: int, input_is_parallel: bool = True) -> None:
            super().__init__()
            self.input_size, self.output_size, self.input_is_parallel, self.skip_bias_add = input_size, output_size, \
                input_is_parallel, False
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size // dist.get_world_size()))
            self.bias = torch.nn.Parameter(torch.empty(output_size))

    @staticmethod
    def get_model_parallel_group():
        return None

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size()

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank()


def _full():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(MID, IN, generator=g), torch.randn(MID, generator=g), torch.randn(OUT, MID, generator=g),
            torch.randn(OUT, generator=g), torch.randn(5, IN, generator=g))


def _reference(world: int, rank: int):
    """Rank `rank`'s output: the partial sums of every rank's shard, then its own (masked) bias, as the layer
    adds it after the all-reduce (each rank masks the bias by its own shard's row mask, as DeepSpeed's)."""
    from deepspeed_c.compression import quant_reference as R

    w1, b1, w2, b2, x = _full()
    x = x.clone().requires_grad_()
    y, masks = 0, []
    for r in range(world):
        s = slice(r * MID // world, (r + 1) * MID // world)
        h = torch.nn.functional.linear(x, R.fake_quant(w1[s], 4, 2), b1[s])  # the column shard, quantized alone
        keep = torch.zeros(OUT)  # the row shard's rows by its own l1 norms
        keep[w2[:, s].abs().sum(1).sort(descending=True)[1][:OUT // 2]] = 1
        masks.append(keep)
        y = y + torch.nn.functional.linear(torch.relu(h), R.fake_quant(w2[:, s], 4, 2) * keep.view(-1, 1))
    y = y + b2 * masks[rank]
    y.sum().backward()
    return y.detach(), x.grad, masks[rank]


def body(rank: int, world: int):
    from deepspeed_c.compression import init_compression
    from deepspeed_c.compression.scheduler import compression_scheduler
    from deepspeed_c.compression.config import get_compression_config

    w1, b1, w2, b2, x = _full()
    model = torch.nn.Module()
    model.col = _Mpu.ColumnParallelLinear(IN, MID, gather_output=False)
    model.row = _Mpu.RowParallelLinear(MID, OUT, input_is_parallel=True)
    s = slice(rank * MID // world, (rank + 1) * MID // world)
    with torch.no_grad():
        model.col.weight.copy_(w1[s]), model.col.bias.copy_(b1[s])
        model.row.weight.copy_(w2[:, s]), model.row.bias.copy_(b2)
    init_compression(model, CONFIG, mpu=_Mpu)
    assert type(model.col).__name__ == "ColumnParallelLinear_Compress"
    assert type(model.row).__name__ == "RowParallelLinear_Compress"
    compression_scheduler(model, get_compression_config(CONFIG)).step(step_zero_check=True)
    x = x.clone().requires_grad_()
    h, _ = model.col(x)
    y, _ = model.row(torch.relu(h))
    y.sum().backward()
    return y.detach().numpy(), x.grad.numpy(), model.row.row_pruning_mask.view(-1).numpy()


def test_parallel_layers_compress_their_shards():
    for rank, (y, g, mask) in enumerate(run_distributed(body, 2)):
        y_ref, g_ref, mask_ref = _reference(2, rank)
        np.testing.assert_array_equal(mask, mask_ref.numpy())
        np.testing.assert_allclose(y, y_ref.numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(g, g_ref.numpy(), atol=1e-5, rtol=1e-5)
