"""Domino's transformer: each micro-batch split in two along the batch, one half's all-reduce in flight
while the other half computes.

A layer is two computations, attention and MLP, each ending in a row-parallel partial sum whose
all-reduce is started asynchronously (`_Pending`) and waited only when the residual add reads it.
Half 1's computation runs while half 0's sum is in flight, and half 0's next computation while half
1's is. DominoTransformerLayer keeps that overlap inside a layer (DeepSpeed's intra-layer overlap);
DominoTransformer's default schedule carries it across layer boundaries (inter-layer overlap). In the
backward, the asynchronous linears overlap their input-gradient all-reduce with the weight-gradient GEMM
(async_linear.py, handles.py). Both schedules compute exactly the unsplit layers.
Activations are [sequence, batch, hidden]; pre-LayerNorm (post with apply_residual_connection_post_layernorm)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from deepspeed_c import comm as dist
from deepspeed_c.accelerator import get_accelerator
from deepspeed_c.module_inject.layers import TPCopy, TPReduce
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.runtime.domino.async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm
from deepspeed_c.runtime.domino.attention import CoreAttention, DominoModule, ShardedAttention  # noqa: F401
from deepspeed_c.runtime.domino.config import check_config, split_micro_batch, tp_group_of
from deepspeed_c.runtime.domino.enums import AttnMaskType, AttnType, LayerType, ModelType  # noqa: F401
from deepspeed_c.runtime.domino.handles import DominoUtil, NoOper, _Wait_bwd_comm  # noqa: F401  (DeepSpeed's names)

__all__ = ["bias_dropout_add", "DominoTransformerLayer", "DominoTransformer"]

_HALVES = (DominoUtil.BATCH_0, DominoUtil.BATCH_1)


class bias_dropout_add(torch.nn.Module):
    """residual + dropout(x + bias)."""

    def __init__(self, prob: float) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(prob)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        if bias is not None:
            x = x + bias
        return self.dropout(x) + residual


class _RowSum(torch.autograd.Function):
    """This rank's partial, which _Pending sums in place over the group outside autograd: the node autograd
    sees for that sum. Its adjoint is the identity (the loss is replicated); a create_graph backward records
    it as TPCopy, whose own adjoint is the all-reduce, so the second-order terms reaching the gradient are
    summed over the ranks as they would be through TPReduce (without the node, autograd saw the output as
    this rank's partial alone: every create_graph penalty lost the other ranks' terms)."""

    @staticmethod
    def forward(group: Any, partial: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return partial.view_as(partial)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph: keep the sum's adjoint differentiable
            return None, TPCopy.apply(ctx.group, grad)
        return None, grad


class _Pending:
    """A partial sum whose all-reduce is in flight, and what to add to it once it lands."""

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, group: Any,
                 tp: int, add: bias_dropout_add) -> None:
        self.bias, self.residual, self.add = bias, residual, add
        self.handle = None
        if tp > 1 and transforms_active():
            # torch.func (grad, vmap): the collective must see the transform's tensors (an in-place all-reduce
            # of a vmapped tensor has no batching rule), so the sum is TPReduce, synchronous
            self.partial = TPReduce.apply(group, partial)
        elif tp > 1:
            # summed in place through a detached alias while the other half computes; _RowSum is the sum's node
            # in the graph (nothing saves the partial for backward, so the in-place write is safe)
            self.partial = _RowSum.apply(group, partial)
            self.handle = dist.all_reduce(self.partial.detach(), group=group, async_op=True)
        else:
            self.partial = partial

    def finish(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.wait()
        return self.add(self.partial, self.bias, self.residual)


def _split_mask(mask: Optional[torch.Tensor], batch: int) -> tuple:
    """Each half's attention mask: a mask with a batch dimension of the micro-batch is split with it."""
    if mask is None or mask.dim() == 0 or mask.shape[0] == 1:
        return mask, mask
    if mask.shape[0] != batch:
        raise ValueError(f"Domino: attention_mask has batch dimension {mask.shape[0]} (shape {tuple(mask.shape)}), "
                         f"neither 1 nor the micro-batch size {batch}")
    half0, half1 = torch.chunk(mask, 2, dim=0)
    return half0, half1


class DominoTransformerLayer(DominoModule):
    """One transformer layer over the two halves: ([s, b/2, h], [s, b/2, h]) -> same."""

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Optional[Callable], layer_number: int,
                 layer_type: LayerType = LayerType.encoder,
                 self_attn_mask_type: AttnMaskType = AttnMaskType.causal, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.TP_group, self.tp_world_size = tp_group_of(mpu, "DominoTransformerLayer")
        check_config(config, self.tp_world_size, "DominoTransformerLayer")
        self.layer_number, self.layer_type = layer_number, layer_type
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm
        self.recompute = getattr(config, "recompute_granularity", None) == "full"
        self.llama_model = False
        device = get_accelerator().current_device_name()
        norm = dict(eps=config.layernorm_epsilon, device=device, dtype=config.params_dtype)
        self.input_layernorm = torch.nn.LayerNorm(config.hidden_size, **norm)
        self.self_attention = ShardedAttention(config, mpu, apply_rotary_pos_emb, layer_number,
                                               attention_type=AttnType.self_attn, attn_mask_type=self_attn_mask_type)
        self.hidden_dropout = config.hidden_dropout
        self.post_attention_layernorm = torch.nn.LayerNorm(config.hidden_size, **norm)
        tp = self.tp_world_size
        self.output_size_c = self.input_size_r = config.ffn_hidden_size
        self.input_size_c = self.output_size_r = config.hidden_size
        self.output_size_per_partition = self.input_size_per_partition = config.ffn_hidden_size // tp
        self.linear_fc1 = DominoAsyncColumnParallelLinear(config.hidden_size, self.output_size_per_partition,
                                                          self.TP_group, config=config,
                                                          init_method=config.init_method, bias=config.add_bias_linear)
        self.mlp_activation_func = F.gelu
        self.linear_fc2 = RowParallelLinearNoComm(self.input_size_per_partition, config.hidden_size, config=config,
                                                  init_method=config.output_layer_init_method,
                                                  bias=config.add_bias_linear, skip_bias_add=True)
        self.bias_dropout_add_func = bias_dropout_add(self.hidden_dropout)

    # -- the two computations of a half, each ending in a started all-reduce
    def _run(self, fn: Callable, x: torch.Tensor) -> tuple:
        # recomputation replays only the computation between two all-reduces: it never communicates
        return checkpoint(fn, x, use_reentrant=False) if self.recompute and torch.is_grad_enabled() else fn(x)

    def _residual(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.apply_residual_connection_post_layernorm else x

    def attention_part(self, x: torch.Tensor, mask: Optional[torch.Tensor], h_id: str, rotary_pos_emb: Any) -> _Pending:
        def compute(x: torch.Tensor) -> tuple:
            normed = self.input_layernorm(x)
            partial, _ = self.self_attention(normed, mask, h_id, rotary_pos_emb=rotary_pos_emb)
            return partial, normed

        partial, normed = self._run(compute, x)
        return _Pending(partial, self.self_attention.dense.bias, self._residual(x, normed), self.TP_group,
                        self.tp_world_size, self.bias_dropout_add_func)

    def mlp_part(self, x: torch.Tensor, mask: Optional[torch.Tensor], h_id: str, rotary_pos_emb: Any) -> _Pending:
        def compute(x: torch.Tensor) -> tuple:
            normed = self.post_attention_layernorm(x)
            waited = _Wait_bwd_comm(normed, DominoUtil.HANDLE_DIC, h_id)  # fc1's input-gradient all-reduce
            hidden, _ = self.linear_fc1(waited, DominoUtil.HANDLE_DIC, h_id)
            partial, _ = self.linear_fc2(self.mlp_activation_func(hidden))
            return partial, normed

        partial, normed = self._run(compute, x)
        return _Pending(partial, self.linear_fc2.bias, self._residual(x, normed), self.TP_group, self.tp_world_size,
                        self.bias_dropout_add_func)

    def forward(self, hidden_states: tuple, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Any = None) -> tuple:
        if not isinstance(hidden_states, (tuple, list)) or len(hidden_states) != 2:
            raise ValueError("DominoTransformerLayer: hidden_states must be the two halves (hidden_states0, "
                             f"hidden_states1) of a micro-batch, got {type(hidden_states).__name__}")
        x0, x1 = hidden_states
        mask0, mask1 = _split_mask(attention_mask, x0.shape[1] + x1.shape[1])
        attn0 = self.attention_part(x0, mask0, DominoUtil.BATCH_0, rotary_pos_emb)
        attn1 = self.attention_part(x1, mask1, DominoUtil.BATCH_1, rotary_pos_emb)  # while half 0's sum flies
        mlp0 = self.mlp_part(attn0.finish(), mask0, DominoUtil.BATCH_0, rotary_pos_emb)  # while half 1's flies
        mlp1 = self.mlp_part(attn1.finish(), mask1, DominoUtil.BATCH_1, rotary_pos_emb)
        return mlp0.finish(), mlp1.finish()


class DominoTransformer(DominoModule):
    """A stack of Domino layers (and the final LayerNorm): [s, b, h] -> [s, b, h], b even."""

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Optional[Callable], model_type: Any,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True,
                 drop_path_rate: float = 0.0) -> None:
        super().__init__()
        self.TP_group, tp = tp_group_of(mpu, "DominoTransformer")
        check_config(config, tp, "DominoTransformer")
        if not dist.is_initialized():
            dist.init_distributed()
        self.layer_type, self.model_type = layer_type, model_type
        self.post_layer_norm, self.pre_process, self.post_process = post_layer_norm, pre_process, post_process
        self.input_tensor = None
        self.drop_path_rate = drop_path_rate
        self.num_layers = config.num_layers
        self.drop_path_rates = [r.item() for r in torch.linspace(0, drop_path_rate, max(1, config.num_layers))]
        self.layers = torch.nn.ModuleList([
            DominoTransformerLayer(config, mpu, apply_rotary_pos_emb, i + 1, layer_type=layer_type,
                                   self_attn_mask_type=self_attn_mask_type, drop_path_rate=self.drop_path_rates[i])
            for i in range(self.num_layers)])
        if post_process and post_layer_norm:
            self.final_layernorm = torch.nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                                                      device=get_accelerator().current_device_name(),
                                                      dtype=config.params_dtype)
        self.intra_layer_overlap = bool(getattr(config, "domino_intra_layer_overlap", False))
        self._forward_impl = self.intra_layer_overlap_forward if self.intra_layer_overlap \
            else self.inter_layer_overlap_forward

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Any = None) -> torch.Tensor:
        return self._forward_impl(hidden_states, attention_mask, rotary_pos_emb)

    def _final(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(x) if self.post_process and self.post_layer_norm else x

    def inter_layer_overlap_forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                    rotary_pos_emb: Any = None) -> torch.Tensor:
        """Half 1's sum stays in flight across the layer boundary, under half 0's next computation."""
        x = list(split_micro_batch(hidden_states, "DominoTransformer"))
        masks = _split_mask(attention_mask, hidden_states.shape[1])
        pending: list = [None, None]
        for layer in self.layers:
            for part in (layer.attention_part, layer.mlp_part):
                for h in (0, 1):
                    if pending[h] is not None:
                        x[h] = pending[h].finish()
                    pending[h] = part(x[h], masks[h], _HALVES[h], rotary_pos_emb)
        out = [self._final(p.finish() if p is not None else x[h]) for h, p in enumerate(pending)]
        return torch.cat(out, dim=1)

    def intra_layer_overlap_forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                    rotary_pos_emb: Any = None) -> torch.Tensor:
        """Both halves' last sums are waited at the end of every layer."""
        halves = split_micro_batch(hidden_states, "DominoTransformer")
        for layer in self.layers:
            halves = layer(halves, attention_mask, rotary_pos_emb)
        return torch.cat([self._final(h) for h in halves], dim=1)
