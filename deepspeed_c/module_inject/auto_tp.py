"""AutoTP detection and replacement: which Linear layers of a Hugging Face decoder are column- and which
row-parallel, found from the module names (and, for a custom plan, `partition_config` regexes).

Column parallel (output features split): the projections that fan out of the residual stream --
q/k/v, fused qkv, gate/up, fc1, c_attn/c_fc (GPT-2), query_key_value/dense_h_to_4h (BLOOM, GPT-NeoX).
Row parallel (input features split, all-reduced): the projections that fan back in -- o_proj/out_proj,
down_proj, fc2, c_proj, dense_4h_to_h, and `dense` beside a column-parallel sibling (BLOOM/NeoX attention).
Everything else (embeddings, norms, lm_head, routers) stays replicated. Fused concatenations
([q|k|v] in c_attn/qkv_proj, [gate|up]) are split per part so each rank gets whole heads of each.
"""
from __future__ import annotations

import copy
import inspect
import re
from typing import Any, Optional

import torch
from torch import nn

from deepspeed_c import comm as dist
from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer

COLUMN_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_attn", "c_fc",
                          "query_key_value", "dense_h_to_4h", "query", "key", "value", "w1", "w3", "wq", "wk", "wv",
                          "qkv_proj", "gate_up_proj", "Wqkv", "fc_in"})
ROW_NAMES = frozenset({"o_proj", "out_proj", "down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2", "wo", "fc_out"})
# attributes of an attention block that count heads or features of the sharded projections
_SHARDED_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "num_kv_heads",
                  "split_size", "embed_dim", "all_head_size", "hidden_size_per_partition")


def _is_conv1d(module: nn.Module) -> bool:  # transformers.pytorch_utils.Conv1D (GPT-2): weight is [in, out]
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _as_linear(module: nn.Module) -> nn.Module:
    """A Conv1D as the nn.Linear it computes (weight transposed to [out, in])."""
    if not _is_conv1d(module):
        return module
    lin = nn.Linear(module.weight.shape[0], module.weight.shape[1], bias=module.bias is not None,
                    device="meta")
    lin.weight = nn.Parameter(module.weight.data.t().contiguous(), requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        lin.bias = module.bias
    return lin


def _model_config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _fused_sizes(leaf: str, out_features: int, cfg: Any) -> Optional[list[int]]:
    """Part sizes (along the output features) of a concatenated fused projection, or None."""
    if leaf == "c_attn":
        return [out_features // 3] * 3
    if leaf == "gate_up_proj":
        return [out_features // 2] * 2
    if leaf in ("qkv_proj", "Wqkv") and cfg is not None:
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hidden = getattr(cfg, "hidden_size", None)
        if heads and hidden:
            hd = getattr(cfg, "head_dim", None) or hidden // heads
            return [heads * hd, kv * hd, kv * hd]
    return None


class _Rule:
    def __init__(self, patterns: list[str], kind: str, shape: Any = None) -> None:
        self.patterns = [re.compile(p) for p in patterns]
        self.kind = kind
        self.shape = shape

    def matches(self, name: str) -> bool:
        return any(p.search(name) or p.search(name + ".weight") for p in self.patterns)


def _custom_rules(partition_config: Optional[dict]) -> tuple[list[_Rule], bool]:
    if not partition_config:
        return [], True
    unknown = set(partition_config) - {"use_default_specs", "layer_specs"}
    if unknown:
        raise ValueError(f"tensor_parallel.partition_config: unknown key(s) {sorted(unknown)}; valid keys are "
                         "'use_default_specs' and 'layer_specs'")
    rules = []
    for i, spec in enumerate(partition_config.get("layer_specs", [])):
        kind = str(spec.get("partition_type", "column")).lower()
        if kind not in ("column", "row", "skip"):
            raise ValueError(f"tensor_parallel.partition_config.layer_specs[{i}].partition_type={kind!r}: expected "
                             "'column', 'row' or 'skip'")
        patterns = spec.get("patterns")
        if not patterns or not isinstance(patterns, list):
            raise ValueError(f"tensor_parallel.partition_config.layer_specs[{i}].patterns must be a non-empty list "
                             "of regular expressions")
        rules.append(_Rule(patterns, kind, spec.get("shape")))
    return rules, bool(partition_config.get("use_default_specs", True))


def plan(model: nn.Module, partition_config: Optional[dict] = None) -> list[tuple[str, str, Optional[list[int]]]]:
    """[(qualified module name, 'column' | 'row', fused part sizes or None)] for the Linear layers AutoTP shards."""
    rules, use_defaults = _custom_rules(partition_config)
    cfg = _model_config(model)
    modules = dict(model.named_modules())
    out = []
    for name, module in modules.items():
        if not _linear_like(module) or isinstance(module, TensorParallel_Layer):
            continue
        out_features = module.weight.shape[1] if _is_conv1d(module) else module.weight.shape[0]
        rule = next((r for r in rules if r.matches(name)), None)
        if rule is not None:
            if rule.kind == "skip":
                continue
            sizes = None
            if rule.shape is not None and isinstance(rule.shape[0], int) and rule.shape[0] > 1:
                sizes = [out_features // rule.shape[0]] * rule.shape[0]
            elif rule.shape is not None and isinstance(rule.shape[0], (list, tuple)):
                sizes = [int(s) for s in rule.shape[0]]
            out.append((name, rule.kind, sizes))
            continue
        if not use_defaults:
            continue
        leaf = name.rsplit(".", 1)[-1]
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        if leaf in COLUMN_NAMES:
            out.append((name, "column", _fused_sizes(leaf, out_features, cfg)))
        elif leaf in ROW_NAMES or (leaf == "dense" and parent is not None and any(
                n in COLUMN_NAMES for n, _ in parent.named_children())):
            out.append((name, "row", None))
    return out


def _check_heads(model: nn.Module, tp_size: int) -> None:
    cfg = _model_config(model)
    if cfg is None:
        return
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value % tp_size != 0:
            raise ValueError(f"AutoTP: the model's {key}={value} is not divisible by the tensor-parallel size "
                             f"{tp_size} (tensor_parallel.autotp_size): each rank must hold whole heads")


def _set_child(model: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, child)


def apply_autotp(model: nn.Module, tp_group: Any, partition_config: Optional[dict] = None,
                 layers: Optional[list] = None) -> nn.Module:
    """Replaces the model's column/row-parallel Linear layers (in place) with LinearLayer / LinearAllreduce
    holding this rank's shard; returns the model. Every rank of the group must call it on the same model.
    `layers` (a plan() result) replaces the detection (AutoTP inference widens it)."""
    tp_size = dist.get_world_size(tp_group)
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters()):
        raise ValueError("AutoTP: the model has uninitialized (lazy) parameters; run a forward first")
    layers = plan(model, partition_config) if layers is None else layers
    if not layers:
        raise ValueError(f"AutoTP: no Linear layer of {type(model).__name__} was recognised as column- or row-parallel "
                         f"(known column names: {sorted(COLUMN_NAMES)}; row names: {sorted(ROW_NAMES)}); name the "
                         "layers with tensor_parallel.partition_config.layer_specs")
    if not any(kind == "row" for _, kind, _ in layers) or not any(kind == "column" for _, kind, _ in layers):
        raise ValueError(f"AutoTP: {type(model).__name__} has only {layers[0][1]}-parallel layers among "
                         f"{[n for n, _, _ in layers][:6]}: column layers must feed row layers for the shards to "
                         "sum to the full output")
    _check_heads(model, tp_size)
    owners: set[str] = set()
    for name, kind, sizes in layers:
        original = model.get_submodule(name)
        conv1d = _is_conv1d(original)
        linear = _as_linear(original)
        if kind == "column":
            layer: TensorParallel_Layer = LinearLayer(linear, tp_group, name=name, fused_sizes=sizes)
        else:
            layer = LinearAllreduce(linear, tp_group, name=name)
        layer.conv1d = conv1d
        _set_child(model, name, layer)
        owners.add(name.rpartition(".")[0])
    if tp_size > 1:
        _shrink_attributes(model, owners, tp_size)
    model.ds_autotp_parsed = True
    return model


def _shrink_attributes(model: nn.Module, owners: set[str], tp_size: int) -> None:
    """Head counts and feature widths that attention blocks read in forward (BLOOM's num_heads, GPT-2's
    split_size) now describe one rank's shard."""
    for name in owners:
        module = model.get_submodule(name) if name else model
        kinds = {type(c) for c in module.children()}
        if not (LinearLayer in kinds and LinearAllreduce in kinds):
            continue  # an MLP reads no head count; only a block with both kinds of projection
        heads = getattr(module, "num_heads", None)
        if isinstance(heads, int) and heads > 0 and "alibi" in inspect.signature(module.forward).parameters:
            module.register_forward_pre_hook(_alibi_slicer(heads, tp_size, _tp_rank(module)), with_kwargs=True)
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "num_attention_heads"):
            # a block that reads head counts off its config at forward (Phi-3's qkv split) gets its own copy
            # with this rank's counts; head_dim was computed at construction and stays
            local = copy.copy(cfg)
            for attr in ("num_attention_heads", "num_key_value_heads"):
                value = getattr(cfg, attr, None)
                if isinstance(value, int) and value > 0:
                    setattr(local, attr, value // tp_size)
            module.config = local
        for attr in _SHARDED_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                if value % tp_size != 0:
                    raise ValueError(f"AutoTP: {name}.{attr}={value} is not divisible by the tensor-parallel size "
                                     f"{tp_size}")
                setattr(module, attr, value // tp_size)


def _tp_rank(module: nn.Module) -> int:
    return next(c.tp_index for c in module.children() if isinstance(c, TensorParallel_Layer))


def _alibi_slicer(heads: int, tp_size: int, rank: int) -> Any:
    """BLOOM's ALiBi bias comes from the model for every head ([batch * heads, 1, keys]): keep this rank's heads."""
    local = heads // tp_size

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        alibi = kwargs.get("alibi")
        if alibi is None or alibi.shape[0] % heads != 0:
            return None
        mine = alibi.view(alibi.shape[0] // heads, heads, *alibi.shape[1:])[:, rank * local:(rank + 1) * local]
        kwargs["alibi"] = mine.reshape(-1, *alibi.shape[1:])
        return args, kwargs

    return hook
