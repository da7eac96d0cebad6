"""Module surgery for compression: finding, replacing and fixing layers by dotted name."""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepspeed_c.compression import constants as C
from deepspeed_c.compression.basic_layer import (BNLayer_Compress, Conv2dLayer_Compress, Embedding_Compress,
                                                 LinearLayer_Compress)


def recursive_getattr(model: torch.nn.Module, module_name: str) -> Any:
    out: Any = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: torch.nn.Module, module_name: str, module: Any) -> None:
    *parents, last = module_name.split(".")
    out: Any = model
    for name in parents:
        out = getattr(out, name)
    setattr(out, last, module)


def is_module_compressible(module: torch.nn.Module, mpu: Any = None) -> bool:
    kinds: tuple = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding, torch.nn.BatchNorm2d)
    if mpu is not None:
        kinds = kinds + (mpu.RowParallelLinear, mpu.ColumnParallelLinear)
    return isinstance(module, kinds)


def _compressed(old: torch.nn.Module, mpu: Any = None) -> Optional[torch.nn.Module]:
    """The compression-aware twin of `old` sharing its tensors (old itself when it already is one). The twin is
    built through its constructor, so its default initialisation draws from the RNG as DeepSpeed's does."""
    if isinstance(old, (LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress)):
        return old
    w = getattr(old, "weight", None)
    if w is None:
        return None
    has_bias = getattr(old, "bias", None) is not None
    new: torch.nn.Module
    if mpu is not None and isinstance(old, mpu.ColumnParallelLinear):
        from deepspeed_c.compression.parallel_layer import ColumnParallelLinear_Compress

        new = ColumnParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=has_bias,
                                            gather_output=old.gather_output, skip_bias_add=old.skip_bias_add)
    elif mpu is not None and isinstance(old, mpu.RowParallelLinear):
        from deepspeed_c.compression.parallel_layer import RowParallelLinear_Compress

        new = RowParallelLinear_Compress(mpu, old.input_size, old.output_size, bias=has_bias,
                                         input_is_parallel=old.input_is_parallel, skip_bias_add=old.skip_bias_add)
    elif isinstance(old, torch.nn.Linear):
        new = LinearLayer_Compress(old.in_features, old.out_features, bias=has_bias)
    elif isinstance(old, torch.nn.Conv2d):
        new = Conv2dLayer_Compress(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                                   old.dilation, old.groups, has_bias, old.padding_mode)
    elif isinstance(old, torch.nn.BatchNorm2d):
        new = BNLayer_Compress(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats)
    elif isinstance(old, torch.nn.Embedding):
        new = Embedding_Compress(old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
                                 old.scale_grad_by_freq, old.sparse)
    else:
        return None
    new = new.to(device=w.device, dtype=w.dtype)
    new.weight.data = w.data
    if has_bias:
        new.bias.data = old.bias.data
    if isinstance(old, torch.nn.BatchNorm2d):
        new.running_mean.data = old.running_mean.data
        new.running_var.data = old.running_var.data
    if hasattr(w, "start_bits"):
        new.weight.start_bits, new.weight.target_bits, new.weight.q_period = w.start_bits, w.target_bits, w.q_period
    return new


def _enable(module: Any, technique: str, v: dict) -> None:
    if not v[C.TECHNIQUE_ENABLED]:
        return
    if technique == C.SPARSE_PRUNING:
        module.enable_sparse_pruning(v[C.PRUNING_DENSE_RATIO], v[C.PRUNING_METHOD])
    elif technique == C.ROW_PRUNING:
        module.enable_row_pruning(v[C.PRUNING_DENSE_RATIO], v[C.PRUNING_METHOD])
    elif technique == C.HEAD_PRUNING:
        module.enable_head_pruning(v[C.PRUNING_DENSE_RATIO], v[C.PRUNING_METHOD], v[C.HEAD_PRUNING_NUM_HEADS])
    elif technique == C.ACTIVATION_QUANTIZATION:
        module.enable_activation_quantization(v[C.ACTIVATION_QUANTIZE_BITS], v[C.ACTIVATION_QUANTIZE_TYPE],
                                              v[C.ACTIVATION_QUANTIZE_RANGE])
    elif technique == C.WEIGHT_QUANTIZATION:
        module.enable_weight_quantization(v[C.WEIGHT_QUANTIZE_START_BITS], v[C.WEIGHT_QUANTIZE_TARGET_BITS],
                                          v[C.WEIGHT_QUANTIZATION_PERIOD], v[C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED],
                                          v[C.WEIGHT_QUANTIZE_TYPE], v[C.WEIGHT_QUANTIZE_GROUPS])
    elif technique == C.CHANNEL_PRUNING:
        module.enable_channel_pruning(v[C.PRUNING_DENSE_RATIO], v[C.PRUNING_METHOD])
    else:
        raise ValueError(f"compression technique {technique!r} is not implemented")


_SUPPORTS = {C.ROW_PRUNING: "enable_row_pruning", C.HEAD_PRUNING: "enable_head_pruning",
             C.CHANNEL_PRUNING: "enable_channel_pruning", C.SPARSE_PRUNING: "enable_sparse_pruning",
             C.ACTIVATION_QUANTIZATION: "enable_activation_quantization"}


def module_replacement(model: torch.nn.Module, module_name: str, compression_technique: Optional[dict] = None,
                       mpu: Any = None) -> None:
    new = _compressed(recursive_getattr(model, module_name), mpu)
    if compression_technique is not None and new is not None:
        for technique, v in compression_technique.items():
            need = _SUPPORTS.get(technique)
            if v[C.TECHNIQUE_ENABLED] and need and not hasattr(new, need):
                raise ValueError(f"compression_training.{technique}: module {module_name!r} "
                                 f"({type(new).__name__}) does not support it")
            _enable(new, technique, v)
    recursive_setattr(model, module_name, new)


def compression_preparation(model: torch.nn.Module, compression_technique_list: list, mpu: Any) -> torch.nn.Module:
    # every compressible layer becomes its twin first, then the listed ones get their techniques
    for module_name, module in list(model.named_modules()):
        if is_module_compressible(module, mpu):
            module_replacement(model, module_name, mpu=mpu)
    for module_name_lists, _, technique in compression_technique_list:
        for names in module_name_lists:
            for module_name in names:
                module_replacement(model, module_name, technique, mpu=mpu)
    return model


def fix_compression(model: torch.nn.Module, module_name: str, compression_technique: dict,
                    mask: Optional[torch.Tensor] = None, dim_reduction: bool = False) -> Optional[torch.Tensor]:
    module = recursive_getattr(model, module_name)
    for k, v in compression_technique.items():
        if k == C.WEIGHT_QUANTIZATION and v[C.WEIGHT_QUANTIZE_IN_FORWARD_ENABLED] and v[C.TECHNIQUE_ENABLED]:
            return module.fix_weight_quantization()
        if k == C.SPARSE_PRUNING and v[C.TECHNIQUE_ENABLED]:
            return module.fix_sparse_pruning_helper()
        if k == C.ROW_PRUNING and (v[C.TECHNIQUE_ENABLED] or mask is not None):
            return module.fix_row_col_pruning_helper(mask, dim_reduction=dim_reduction)
        if k == C.HEAD_PRUNING and (v[C.TECHNIQUE_ENABLED] or mask is not None):
            return module.fix_head_pruning_helper(mask, v[C.HEAD_PRUNING_NUM_HEADS], dim_reduction=dim_reduction)
        if k == C.CHANNEL_PRUNING and (v[C.TECHNIQUE_ENABLED] or mask is not None):
            return module.fix_channel_pruning_helper(mask, dim_reduction=dim_reduction)
    return None


def convert_conv1d_to_linear(model: torch.nn.Module, convert_type: type) -> torch.nn.Module:
    """Swap every `convert_type` layer (e.g. HF GPT-2's Conv1D, weight stored (in, out)) for an nn.Linear."""
    c_model = model.module if hasattr(model, "module") else model
    for name, old in list(c_model.named_modules()):
        if isinstance(old, convert_type):
            new = torch.nn.Linear(old.weight.data.size(0), old.weight.data.size(1), bias=old.bias is not None)
            new.weight.data = old.weight.data.t().contiguous()
            if new.bias is not None:
                new.bias.data = old.bias.data.view(-1)
            recursive_setattr(c_model, name, new)
    return model
