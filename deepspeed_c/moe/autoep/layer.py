"""AutoEPExperts: the experts of one Hugging Face MoE block, split over an expert-parallel group.

It takes the place of the block's experts child and keeps its call (hidden [T, H], top-k expert ids [T, k],
top-k weights [T, k]) -> [T, H], so the block's own forward, its router (replicated) and any shared expert
(replicated) run unchanged. Rank r of a group of ep ranks holds global experts [r*L, (r+1)*L), L = E / ep.

Forward: the (token, choice) pairs are sorted by expert; the rows for each rank's experts travel there by one
all_to_all (the per-expert counts by one before), are run expert by expert, travel back by the reverse
exchange, and are weighted and summed per token on the rank that owns the token. The routing weight is
applied after the expert, in the activation dtype, as Hugging Face's experts do.

The local weights are the block's own Parameter objects with their data narrowed to this rank's experts (an
optimizer or a parameter list made before initialize stays valid), marked as DeepSpeed marks expert
parameters (allreduce False, group_name ep_size_{ep}) so the engine reduces their gradients over the
expert-data-parallel group and everything else over the data-parallel group."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from deepspeed_c.moe.autoep.exchange import exchange, exchange_counts


def local_slice(ep_rank: int, ep_size: int, num_experts: int) -> slice:
    per = num_experts // ep_size
    return slice(ep_rank * per, (ep_rank + 1) * per)


class AutoEPExperts(nn.Module):

    def __init__(self, w1: nn.Parameter, w2: nn.Parameter, act_fn: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 num_experts: int, ep_size: int, ep_rank: int, route_scale: float = 1.0,
                 names: tuple[str, str] = ("gate_up_proj", "down_proj"),
                 gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """act_fn: the experts' activation, act_fn(gate) * up; gate_fn (instead): the Hugging Face experts' own
        gated activation of the fused gate-and-up output (MiniMax-M3's clamped SwiGLU, `_apply_gate`)."""
        super().__init__()
        if act_fn is None and gate_fn is None:
            raise ValueError("AutoEPExperts needs act_fn or gate_fn")
        self.gate_fn = gate_fn
        self.num_experts = num_experts  # global: the engine's MoE bookkeeping counts the whole layer
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.route_scale = float(route_scale)
        self.act_fn = act_fn
        self.w1_name, self.w2_name = names
        keep = local_slice(ep_rank, ep_size, num_experts)
        for name, p in zip(names, (w1, w2)):
            with torch.no_grad():
                p.data = p.data[keep].clone()  # the same Parameter object, this rank's experts only
            p.allreduce = False
            p.group_name = self.expert_group_name
            self.register_parameter(name, p)
        self.ep_group: Optional[Any] = None

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Creates (once per ep size) the expert-parallel and expert-data-parallel groups; the engine calls it."""
        from deepspeed_c.utils import groups

        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)

    def _run_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by local expert (counts[j] rows for expert j) through their experts, same order."""
        w1, w2 = getattr(self, self.w1_name), getattr(self, self.w2_name)
        outs = []
        for j, chunk in enumerate(rows.split(counts)):
            gate_up = F.linear(chunk, w1[j])
            if self.gate_fn is not None:
                hidden = self.gate_fn(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = self.act_fn(gate) * up
            outs.append(F.linear(hidden, w2[j]))
        return torch.cat(outs) if outs else rows.new_zeros((0, w2.shape[1]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        owner = order // k  # the token of each sorted (token, choice) pair
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = hidden_states[owner]
        if self.ep_size == 1:
            done = self._run_local(rows, counts.tolist())
        else:
            if self.ep_group is None:
                raise RuntimeError("AutoEPExperts with ep_size > 1 has no expert-parallel group: deepspeed.initialize "
                                   "creates it (set_deepspeed_parallelism)")
            send = counts.view(self.ep_size, self.num_local_experts)
            recv = exchange_counts(send, self.ep_group)  # recv[r, j]: rows rank r sends to my expert j
            send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
            got = exchange(rows, recv_splits, send_splits, self.ep_group)  # by source rank, then expert
            local_ids = torch.arange(self.num_local_experts, device=recv.device).repeat(self.ep_size)
            by_expert = torch.argsort(torch.repeat_interleave(local_ids, recv.reshape(-1)), stable=True)
            ran = self._run_local(got[by_expert], recv.sum(0).tolist())
            back = torch.empty_like(ran).index_copy(0, by_expert, ran)  # source-rank order again
            done = exchange(back, send_splits, recv_splits, self.ep_group)
        weights = top_k_weights.reshape(-1)[order, None] * self.route_scale
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, owner, (done * weights).to(hidden_states.dtype))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, "
                f"local_experts={self.num_local_experts}")
