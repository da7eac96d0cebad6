"""DeepSpeed's compression-aware layers (same class names, attributes and state-dict keys):
LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress, BNLayer_Compress and the static range
observer QuantAct. init_compression swaps them in for nn.Linear / nn.Conv2d / nn.Embedding / nn.BatchNorm2d;
the compression scheduler flips their `*_enabled` flags; redundancy_clean folds masks and quantization
into the weights (and, with related modules, shrinks the dimensions).

State added per technique (as DeepSpeed): sparse l1 buffer `sparse_pruning_mask` / topk parameter
`sparse_mask_scores`; row l1 buffer `row_pruning_mask` (out, 1) / topk `row_mask_scores` (out, 1); head
topk parameter `head_pruning_scores` (1, num_heads); channel l1 buffer `channel_pruning_mask`
(out, 1, 1, 1) / topk `channel_mask_scores`; static activation quantization `activation_quantizer.x_min_max`."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepspeed_c.compression.layer_mixins import CompressMixin, QuantAct, _scores, weight_quantizer_for
from deepspeed_c.compression.utils import TopKBinarizer

__all__ = ["QuantAct", "Embedding_Compress", "LinearLayer_Compress", "Conv2dLayer_Compress", "BNLayer_Compress"]


class Embedding_Compress(CompressMixin, nn.Embedding):
    """Embedding whose table can be fake-quantized per token (one group per row)."""

    def __init__(self, *kargs: Any) -> None:
        super().__init__(*kargs)
        self._init_compress_state()

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"weight_quantization={self.weight.target_bits}")

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        self._set_weight_schedule(start_bits, target_bits, quantization_period, weight_quantization_enabled_in_forward)
        if weight_quantization_enabled_in_forward:
            self.weight_quantizer = weight_quantizer_for(target_bits, quantization_type, "Embedding_Compress")
            self.weight_quantize_num_groups = self.weight.size(0)  # token-wise, whatever quantize_groups says

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input, self._forward_weight(), self.padding_idx, self.max_norm, self.norm_type,
                                       self.scale_grad_by_freq, self.sparse)


class LinearLayer_Compress(CompressMixin, nn.Linear):
    """Linear with weight / activation quantization and sparse, row and head pruning."""

    def __init__(self, *kargs: Any, bias: bool = True) -> None:
        super().__init__(*kargs, bias=bias)
        self._init_compress_state()
        self.row_pruning_method: Optional[str] = None
        self.head_pruning_method: Optional[str] = None
        self.row_pruning_enabled = False
        self.head_pruning_enabled = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparse pruning={self.sparse_pruning_method is not None}, "
                f"row pruning={self.row_pruning_method is not None}, "
                f"head pruning={self.head_pruning_method is not None}, "
                f"activation quantization={self.activation_quantization_method is not None}, "
                f"weight_quantization={self.weight.target_bits}")

    # -- row pruning (output rows; with related modules, their input columns go too) ----------------
    def enable_row_pruning(self, ratio: float, method: str) -> None:
        self.row_pruning_ratio = ratio
        self.row_pruning_method = method
        mask = None
        if method == "l1":
            norm = torch.linalg.norm(self.weight.data, ord=1, dim=1)
            mask = TopKBinarizer.apply(norm, ratio, False).view(-1, 1)
        elif method == "topk":
            self.row_mask_scores = _scores((self.weight.size(0), 1), self.weight.device)
        else:
            raise ValueError(f"LinearLayer_Compress: row pruning method must be 'l1' or 'topk', got {method!r}")
        self.register_buffer("row_pruning_mask", mask)

    # -- head pruning (input columns of the attention output projection, in num_heads blocks) ------
    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        if method != "topk":
            raise ValueError(f"LinearLayer_Compress: head pruning supports method 'topk' only, got {method!r}")
        if self.in_features % num_heads:
            raise ValueError(f"head_pruning: num_heads={num_heads} does not divide in_features={self.in_features} "
                             "of the attention output projection")
        self.num_heads = num_heads
        self.head_pruning_ratio = ratio
        self.head_pruning_method = method
        self.head_pruning_scores = _scores((1, num_heads), self.weight.device)

    def get_mask(self, pruning_type: str = "row") -> torch.Tensor:
        if pruning_type == "sparse":
            return self._sparse_mask()
        if pruning_type == "row":
            if self.row_pruning_method == "l1":
                return self.row_pruning_mask.to(self.weight.device)
            return TopKBinarizer.apply(self.row_mask_scores, self.row_pruning_ratio, False)
        if pruning_type == "head":
            return TopKBinarizer.apply(self.head_pruning_scores, self.head_pruning_ratio, False)
        raise ValueError(f"LinearLayer_Compress.get_mask: unknown pruning_type {pruning_type!r}")

    def fix_row_col_pruning_helper(self, mask: Optional[torch.Tensor] = None,
                                   dim_reduction: bool = False) -> Optional[torch.Tensor]:
        if mask is None:  # this layer's own rows
            mask = self.get_mask(pruning_type="row").bool()
            keep = mask.view(-1)
            if dim_reduction:
                self._replace_weight(self.weight.data[keep, :])
                if self.bias is not None:
                    self._replace_bias(self.bias.data[keep])
                self.out_features = self.weight.size(0)
            else:
                self.weight.data = self.weight.data * mask.view(-1, 1)
                if self.bias is not None:
                    self.bias.data = self.bias.data * mask.view(-1)
            del self.row_pruning_mask
            if self.row_pruning_method == "topk":
                del self.row_mask_scores
            self.row_pruning_method = None
        else:  # the next layer's rows went: drop the matching input columns here
            self._replace_weight(self.weight.data[:, mask.view(-1)])
            self.in_features = self.weight.size(1)
            mask = None
        self.row_pruning_enabled = False
        return mask

    def fix_head_pruning_helper(self, mask: Optional[torch.Tensor] = None, num_heads: Optional[int] = None,
                                dim_reduction: bool = False) -> Optional[torch.Tensor]:
        num_heads = num_heads if num_heads else self.num_heads
        if mask is None:
            if self.head_pruning_method != "topk":
                raise ValueError("LinearLayer_Compress.fix_head_pruning_helper: head pruning is not enabled here")
            mask = self.get_mask(pruning_type="head").bool()
            if dim_reduction:
                rows = self.weight.size(0)
                cols = self.weight.data.t().reshape(num_heads, -1)[mask.view(-1), :]
                self._replace_weight(cols.reshape(-1, rows).t())
            else:
                self.weight.data = self.head_pruning_reshape(self.weight.data, mask)
            del self.head_pruning_scores
            self.head_pruning_method = None
        else:  # Q, K, V of the pruned heads: drop their output rows
            cols = self.weight.size(1)
            self._replace_weight(self.weight.data.reshape(num_heads, -1)[mask.view(-1), :].reshape(-1, cols))
            if self.bias is not None:
                self._replace_bias(self.bias.data.reshape(num_heads, -1)[mask.view(-1), :].reshape(-1))
        self.head_pruning_enabled = False
        return mask

    def head_pruning_reshape(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        return (w.t().reshape(self.num_heads, -1) * mask.view(-1, 1)).reshape(cols, rows).t()

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False) -> Any:
        weight, bias = self._sparse(self._forward_weight()), self.bias
        if self.row_pruning_enabled and self.row_pruning_method:
            mask = self.get_mask(pruning_type="row")
            weight = weight * mask.view(-1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        if self.head_pruning_enabled and self.head_pruning_method:
            weight = self.head_pruning_reshape(weight, self.get_mask(pruning_type="head"))
        input = self._quantize_input(input, input.numel() // input.size(-1))  # dynamic: one group per token
        if skip_bias_add:  # model-parallel layers add the bias after their reduction
            return nn.functional.linear(input, weight, None), bias
        return nn.functional.linear(input, weight, bias)


class Conv2dLayer_Compress(CompressMixin, nn.Conv2d):
    """Conv2d with weight / activation quantization, sparse and channel pruning."""

    def __init__(self, *kargs: Any) -> None:
        super().__init__(*kargs)
        self._init_compress_state()
        self.channel_pruning_method: Optional[str] = None
        self.channel_pruning_enabled = False

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, sparse pruning={self.sparse_pruning_method is not None}, "
                f"channel pruning={self.channel_pruning_method is not None}, "
                f"activation quantization={self.activation_quantization_method is not None}, "
                f"weight_quantization={self.weight.target_bits}")

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        if weight_quantization_enabled_in_forward and target_bits < 4:
            raise ValueError(f"Conv2dLayer_Compress: quantize_weight_in_forward needs target_bits >= 4, "
                             f"got {target_bits}")
        super().enable_weight_quantization(start_bits, target_bits, quantization_period,
                                           weight_quantization_enabled_in_forward, quantization_type, num_groups)

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        self.channel_pruning_ratio = ratio
        self.channel_pruning_method = method
        mask = None
        if method == "l1":
            # the L1 norm of each output channel's kernel (DeepSpeed 0.19.6 asks torch.linalg.norm for it over
            # three dims, which torch refuses)
            norm = self.weight.data.abs().sum(dim=(1, 2, 3))
            mask = TopKBinarizer.apply(norm, ratio, False).view(-1, 1, 1, 1)
        elif method == "topk":
            self.channel_mask_scores = _scores((self.weight.size(0), 1, 1, 1), self.weight.device)
        else:
            raise ValueError(f"Conv2dLayer_Compress: channel pruning method must be 'l1' or 'topk', got {method!r}")
        self.register_buffer("channel_pruning_mask", mask)

    def get_mask(self, pruning_type: str = "sparse") -> torch.Tensor:
        if pruning_type == "sparse":
            return self._sparse_mask()
        if pruning_type == "channel":
            if self.channel_pruning_method == "l1":
                return self.channel_pruning_mask.to(self.weight.device)
            return TopKBinarizer.apply(self.channel_mask_scores, self.channel_pruning_ratio, False)
        raise ValueError(f"Conv2dLayer_Compress.get_mask: unknown pruning_type {pruning_type!r}")

    def fix_channel_pruning_helper(self, mask: Optional[torch.Tensor] = None,
                                   dim_reduction: bool = False) -> Optional[torch.Tensor]:
        if mask is None:  # this layer's output channels
            if self.channel_pruning_method not in ("l1", "topk"):
                raise ValueError("Conv2dLayer_Compress.fix_channel_pruning_helper: channel pruning is not enabled")
            mask = self.get_mask(pruning_type="channel").bool()
            keep = mask.view(-1)
            if dim_reduction:
                self._replace_weight(self.weight.data[keep, ...])
                if self.bias is not None:
                    self._replace_bias(self.bias.data[keep])
            else:
                self.weight.data = self.weight.data * mask.view(-1, 1, 1, 1)
                if self.bias is not None:
                    self.bias.data = self.bias.data * mask.view(-1)
            del self.channel_pruning_mask
            if self.channel_pruning_method == "topk":
                del self.channel_mask_scores
            self.channel_pruning_method = None
        else:  # the previous layer's channels went: drop the matching input channels
            self._replace_weight(self.weight.data[:, mask.view(-1), ...])
            mask = None
        self.channel_pruning_enabled = False
        return mask

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self._sparse(self._forward_weight()), self.bias
        if self.channel_pruning_enabled:
            mask = self.get_mask(pruning_type="channel")
            weight = weight * mask.view(-1, 1, 1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        input = self._quantize_input(input, input.numel() // input[0].numel())  # dynamic: one group per sample
        return nn.functional.conv2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class BNLayer_Compress(nn.BatchNorm2d):
    """BatchNorm2d that follows a channel-pruned convolution (its channels shrink with it)."""

    def fix_channel_pruning_helper(self, mask: torch.Tensor, dim_reduction: bool = True) -> None:
        keep = mask.view(-1)
        self.weight = nn.Parameter(self.weight.data[keep])
        self.bias = nn.Parameter(self.bias.data[keep])
        self.running_mean = self.running_mean[keep]
        self.running_var = self.running_var[keep]
