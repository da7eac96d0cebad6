"""`sparse_gradients: true` (DeepSpeed 0.19.6; removed in 0.19.8): the gradients of `nn.Embedding(sparse=True)`
and `nn.EmbeddingBag(sparse=True)` weights are exchanged as sparse rows at stage 0.

A sparse embedding gradient holds only the rows a batch touched. All-reducing it densely sends the whole
table; here each rank's (row indices, row values) are all-gathered instead (padded to the largest rank's
count, as DeepSpeed pads them) and the parameter's .grad becomes the sparse tensor of every rank's rows,
scaled as the dense reduction would be (1 / data-parallel world by default). Its dense form equals the
dense all-reduce's result; rows touched on several ranks appear once per rank, uncoalesced, as in
DeepSpeed. The optimizer must take sparse gradients (torch's SGD, Adagrad, SparseAdam, DeepSpeed's
CPU Adagrad). Gradients that arrive dense (a sparse=False module) are all-reduced densely here too."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from deepspeed_c.runtime.backward_round import BackwardRound
from deepspeed_c.runtime.reduce_strategy import ReduceFactors, averaging_factors


def sparse_embedding_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights whose gradients autograd makes sparse (embedding modules with sparse=True)."""
    out, seen = [], set()
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            if id(m.weight) not in seen:
                seen.add(id(m.weight))
                out.append(m.weight)
    return out


def sparse_module_names(module: torch.nn.Module) -> list[str]:
    """Names of the trainable embedding modules built with sparse=True."""
    return [n for n, m in module.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def check_sparse_supported(names: Sequence[str], what: str) -> None:
    """Refuse, at initialize, sparse embedding modules (`names`) under a gradient path that flattens or
    partitions gradients (`what`: a ZeRO stage, fp16/bf16 fp32 masters): a sparse gradient has no flat view, and
    the run would otherwise fail inside the first backward or step with torch's 'not implemented for sparse'."""
    if names:
        names = list(names)
        raise ValueError(f"{what} cannot take the sparse gradients of the embedding module(s) {names} built with "
                         "sparse=True: build them with sparse=False, or train in fp32 at zero_optimization.stage 0 "
                         "(where sparse_gradients exchanges their rows)")


def _comm() -> Any:
    import deepspeed_c.comm as dist

    return dist


def _gather_padded(t: torch.Tensor, rows: int, most: int, world: int, group: Any) -> torch.Tensor:
    """Every rank's first dimension (`rows` here, `most` at most), concatenated in rank order."""
    padded = torch.zeros((most,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:rows] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    _comm().all_gather(parts, padded, group=group)
    return parts


class SparseGradReducer(BackwardRound):
    """At a reducing backward's end, each parameter's sparse gradient replaced by every rank's rows."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, world_size: int, group: Any,
                 factors: ReduceFactors, should_reduce: Callable[[], bool],
                 scale_for: Optional[Callable[[bool], float]] = None) -> None:
        self.params = list(params)
        self.world_size = world_size
        self.group = group
        self.scale = factors.pre * factors.post  # what the dense path multiplies a gradient by, in all
        # the scale with gradient averaging on / off (set_gradient_average); the factors' own by default
        self._scale_for = scale_for or (lambda average: self.scale if average else 1.0)
        self.should_reduce = should_reduce
        self.collectives = 0
        self._attach_hooks(self.params)

    def set_gradient_average(self, average: bool) -> None:
        """engine.gradient_average assigned after initialize: the next reductions average or sum."""
        self.scale = self._scale_for(average)

    def _start_reducing(self) -> None:
        pass

    def _on_grad(self, index: int) -> None:
        pass  # reduced together at the round's end: every rank walks the same parameters in order

    @torch.no_grad()
    def _finish_round(self) -> None:
        for p in self.params:
            grad = p.grad
            if grad is not None and not grad.is_sparse:
                _comm().all_reduce(grad, group=self.group)
                self.collectives += 1
                grad.mul_(self.scale)
                continue
            p.grad = self._reduce_sparse(p, grad)

    def _reduce_sparse(self, p: torch.nn.Parameter, grad: Any) -> torch.Tensor:
        width = tuple(p.shape[1:])
        if grad is None:  # no rows on this rank: it still takes part with none
            idx = torch.zeros(0, dtype=torch.long, device=p.device)
            val = torch.zeros((0,) + width, dtype=p.dtype, device=p.device)
        else:
            grad = grad.coalesce()
            idx, val = grad.indices()[0], grad.values()
        count = torch.tensor([idx.numel()], dtype=torch.long, device=p.device)
        counts = [torch.empty_like(count) for _ in range(self.world_size)]
        _comm().all_gather(counts, count, group=self.group)
        sizes = [int(c.item()) for c in counts]
        most = max(sizes)
        idx_parts = _gather_padded(idx, idx.numel(), most, self.world_size, self.group)
        val_parts = _gather_padded(val * self.scale, idx.numel(), most, self.world_size, self.group)
        self.collectives += 3
        indices = torch.cat([part[:n] for part, n in zip(idx_parts, sizes)])
        values = torch.cat([part[:n] for part, n in zip(val_parts, sizes)])
        return torch.sparse_coo_tensor(indices.unsqueeze(0), values, tuple(p.shape), device=p.device,
                                       check_invariants=False)  # indices in range by construction


def sparse_reducer(module: torch.nn.Module, config: Any, world_size: int, group: Any, gradient_average: bool,
                   sequence_parallel_size: int, should_reduce: Callable[[], bool]) -> Optional[SparseGradReducer]:
    """The engine's reducer of sparse embedding gradients, or None. Every embedding with sparse=True is
    reduced here, with or without `sparse_gradients`: its gradient is a sparse tensor, which the dense buckets
    cannot hold, and DeepSpeed too exchanges any sparse gradient as sparse rows whatever the key says."""
    params = sparse_embedding_params(module)
    if not params:
        return None
    def factors(average: bool) -> ReduceFactors:
        return averaging_factors(world_size, gradient_average=average, prescale_gradients=config.prescale_gradients,
                                 gradient_predivide_factor=config.gradient_predivide_factor,
                                 sequence_parallel_size=sequence_parallel_size)

    def scale_for(average: bool) -> float:
        f = factors(average)
        return f.pre * f.post

    return SparseGradReducer(params, world_size=world_size, group=group, factors=factors(gradient_average),
                             should_reduce=should_reduce, scale_for=scale_for)
