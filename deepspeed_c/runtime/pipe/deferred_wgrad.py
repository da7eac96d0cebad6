"""Zero-bubble B/W split without a second backward: Linear weight gradients deferred from B to W.

ZB-H1's B pass must produce the stage's input gradients (sent upstream at once) and its W pass the weight
gradients, later. Run as two autograd traversals from the outputs (input gradients first, then the
parameters), the W pass recomputes every activation gradient of the stage on its way to the first layer's
weights: ~1.5 backwards per micro-batch (on 2 H100s, 1.3B GPT, ZB-H1 took 272 ms a step against 1F1B's
235). Here one traversal does it: during B each torch.nn.Linear's backward (runtime/linear_weight_sink.py)
computes its input gradient and stashes (input, output gradient) instead of the weight-gradient GEMM; every
other parameter's gradient (norms, biases, embeddings: cheap) is computed in B too and kept. W multiplies
the stashed pairs and accumulates everything into the parameters through autograd (backward on the
leaves), so the engine's reducer hooks see the gradients as they would after a plain backward.

A Linear whose weight carries a tensor hook computes its weight gradient in B (the hook must see it); the
executor uses the two-traversal path for a stage where any trainable parameter carries a tensor hook (a
hook would otherwise run on the B part in B and again on the total in W). On a ZeRO-1 pipeline these
Linears defer instead of writing into ZeRO's buckets (a pipeline's accumulating micro-batches rarely could)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from deepspeed_c.runtime import linear_weight_sink


class DeferredWeightGrads:
    """The sink of a ZB-H1 stage's Linears: defers their weight gradients while a B pass collects."""

    def __init__(self) -> None:
        self.collecting: Optional[list] = None  # (weight, flat input, flat output gradient) while B runs
        self.linear_backwards = 0  # Linear backward calls, for tests (one per use and micro-batch)
        self.modules: list[torch.nn.Linear] = []

    @contextlib.contextmanager
    def collect(self, into: list) -> Iterator[None]:
        self.collecting = into
        try:
            yield
        finally:
            self.collecting = None

    def weight_grad(self, param: torch.nn.Parameter, flat_input: torch.Tensor,
                    flat_grad: torch.Tensor, node: Any) -> Optional[torch.Tensor]:
        # Only the executor's own B pass defers (its `autograd.grad` over the stage's parameters, inside
        # `collect`); any other backward, and create_graph (never asked here), gets the plain product.
        self.linear_backwards += 1
        if self.collecting is not None and not param._backward_hooks:
            self.collecting.append((param, flat_input, flat_grad))
            return None
        return linear_weight_sink.plain_weight_grad(flat_input, flat_grad)

    def install(self, module: torch.nn.Module) -> None:
        self.modules = linear_weight_sink.install(module, self, accept=lambda m: True)

    def uninstall(self) -> None:
        linear_weight_sink.uninstall(self.modules, self)
        self.modules = []


def weight_totals(params: list[torch.nn.Parameter], computed: tuple, deferred: list) -> list[tuple[Any, Any]]:
    """(parameter, its gradient of one micro-batch) for every parameter that got one: what B computed plus
    the deferred Linear GEMMs."""
    totals: list[Optional[torch.Tensor]] = list(computed)
    index = {id(p): i for i, p in enumerate(params)}
    for weight, flat_input, flat_grad in deferred:
        i = index[id(weight)]
        gw = linear_weight_sink.plain_weight_grad(flat_input, flat_grad)
        totals[i] = gw if totals[i] is None else totals[i] + gw
    return [(p, g) for p, g in zip(params, totals) if g is not None]
