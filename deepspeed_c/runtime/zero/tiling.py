"""TiledLinear: a Linear cut into an out_splits x in_splits grid of smaller Linears, run tile by tile.
Under ZeRO-3 each tile is its own module, so the hooks gather one tile's weight at a time: a layer
whose whole weight would not fit gathered still runs. Same names, arguments and outputs as
DeepSpeed's deepspeed.runtime.zero.TiledLinear; feature boundaries follow partition_uniform (the
first `features % splits` tiles get one feature more)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.runtime.pipe.partition import partition_uniform


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: list[int],
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """`tensor` cut along its last dimension into pieces of the given sizes."""
    if sum(partitions) != tensor.shape[-1]:
        raise ValueError(f"split sizes {partitions} do not add up to the last dimension {tensor.shape[-1]}")
    parts = torch.split(tensor, partitions, dim=-1)
    return tuple(p.contiguous() for p in parts) if contiguous_split_chunks else parts


class TiledSplitsError(RuntimeError, ValueError):
    """A split count outside [1, features]: DeepSpeed documents (and raises) RuntimeError for it; a ValueError
    too, as every other bad argument here."""


class TiledLinear(torch.nn.Module):
    """y = x W^T + b computed as out_splits column blocks, each the sum over in_splits row blocks of
    x_j W_ij^T; the bias sits on the last input tile of each output block. `input_is_already_split`
    takes a list of in_splits input pieces; `combine_out_splits=False` returns the output blocks as a
    list; `linear_cls` builds each tile (with **kwargs); `init_linear` copies a whole Linear's values in."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Any = torch.nn.Linear, init_linear: Optional[torch.nn.Module] = None,
                 **kwargs: Any) -> None:
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features), ("out_splits", out_splits, out_features)):
            if not isinstance(splits, int) or splits < 1 or splits > features:
                raise TiledSplitsError(f"TiledLinear: {name} must be an int in [1, {features}], got {splits!r}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for row in range(out_splits):
            out_dim = self.out_parts[row + 1] - self.out_parts[row]
            self.linears.append(torch.nn.ModuleList(
                linear_cls(self.in_parts[col + 1] - self.in_parts[col], out_dim,
                           bias=bias if col == in_splits - 1 else False, **kwargs)
                for col in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits > 1 and not self.input_is_already_split:
            bounds = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [bounds[i + 1] - bounds[i] for i in range(self.in_splits)])
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: {len(inputs)} input pieces for in_splits={self.in_splits}")
        else:
            inputs = [input_]
        outputs: list[Any] = [None] * self.out_splits
        for row in range(self.out_splits):
            for col in range(self.in_splits):
                outputs[row] = self._reduce_local_output(col, row, outputs[row], self.linears[row][col](inputs[col]))
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Any:  # noqa: A002 (DeepSpeed's)
        """The input cut into in_splits pieces (subclasses override it for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Adds one input tile's contribution to output block out_id."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        if len(outputs) != self.out_splits:
            raise ValueError(f"TiledLinear: {len(outputs)} output blocks for out_splits={self.out_splits}")
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copies a whole Linear's weight (and bias) into the tiles. Under ZeRO-3 a collective: rank 0's
        values reach every rank (GatheredParameters with modifier_rank=0)."""
        from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters

        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"copy_params_from: expected a weight of shape {(self.out_features, self.in_features)}, "
                             f"got {None if weight is None else tuple(weight.shape)}")
        bias = getattr(other, "bias", None)
        if self.use_bias and (bias is None or tuple(bias.shape) != (self.out_features,)):
            raise ValueError(f"copy_params_from: expected a bias of shape {(self.out_features,)}, got "
                             f"{None if bias is None else tuple(bias.shape)}")
        if not self.use_bias and bias is not None:
            raise ValueError("copy_params_from: this TiledLinear has no bias but the source has one")
        for row in range(self.out_splits):
            r0, r1 = self.out_parts[row], self.out_parts[row + 1]
            for col in range(self.in_splits):
                c0, c1 = self.in_parts[col], self.in_parts[col + 1]
                tile = self.linears[row][col]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """For Linear classes that return (output, bias) as Megatron-LM's do: the outputs are summed over
    input tiles and the returned biases are concatenated over output blocks, not summed."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise ValueError("TiledLinearReturnBias: each tile must return a (tensor, bias) pair")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, new_out[0])
        return tensor, new_out[1] if new_out[1] is not None else old_bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (torch.cat(biases, dim=-1) if biases else None)
