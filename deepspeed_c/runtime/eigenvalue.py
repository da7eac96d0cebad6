"""Eigenvalue: the dominant Hessian eigenvalue of each block of a model, by power iteration on
Hessian-vector products (DeepSpeed's `eigenvalue` section; its consumer is MoQ, which picks a block's
quantization schedule from it).

Needs gradients that carry their graph (a backward with create_graph=True), so each Hv is one more
autograd.grad through them. Per block (`layer_name` is the dotted path to the block list, `layer_num` how many
blocks): start from a normal random vector (the torch generator's state is put back afterwards, so training's
random draws do not move), normalise (`stability` added to the norm), iterate v <- H v / |H v| / scale until
the Rayleigh quotient changes by less than `tol` relatively or `max_iter` iterations, then multiply by scale
(the loss scale the gradients carry). The results are mapped to [0, 1] by the largest magnitude (a block with
eigenvalue 0, e.g. one fp16 could not resolve, gets 1.0), returned as {id(param): (value, block index)} for
every parameter of every block, as DeepSpeed returns them."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepspeed_c.utils.logging import logger


class Eigenvalue:

    def __init__(self, verbose: bool = False, max_iter: int = 100, tol: float = 1e-2, stability: float = 0,
                 gas_boundary_resolution: int = 1, layer_name: str = "", layer_num: int = 0) -> None:
        if not layer_name or layer_num <= 0:
            raise ValueError(f"Eigenvalue: config keys 'eigenvalue.layer_name' ({layer_name!r}) and "
                             f"'eigenvalue.layer_num' ({layer_num}) must name the block list and a count > 0")
        self.verbose, self.max_iter, self.tol, self.stability = verbose, max_iter, tol, stability
        self.gas_boundary_resolution = gas_boundary_resolution
        self.layer_name, self.layer_num = layer_name, layer_num

    @staticmethod
    def nan_to_num(x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def inner_product(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum(torch.sum(x * y) for x, y in zip(xs, ys))

    def normalize(self, v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = self.inner_product(v, v) ** 0.5 + self.stability
        return [self.nan_to_num(x / norm) for x in v]

    def get_layers(self, module: torch.nn.Module) -> Any:
        m: Any = module
        for part in self.layer_name.split("."):
            if not hasattr(m, part):
                raise ValueError(f"Eigenvalue: config key 'eigenvalue.layer_name' = {self.layer_name!r}: the model "
                                 f"has no attribute {part!r} on that path")
            m = getattr(m, part)
        return m

    def _block(self, block: torch.nn.Module, device: Optional[torch.device], scale: float) -> Optional[float]:
        params = [p for p in block.parameters() if p.grad is not None and p.grad.grad_fn is not None]
        if not params:
            return None
        rng = torch.random.get_rng_state()
        v = [torch.randn(p.size(), device=device if device is not None else "cpu") for p in params]
        torch.random.set_rng_state(rng)
        v = self.normalize(v)
        grads = [p.grad for p in params]
        current, previous, i = 1.0, 0.0, 0
        while i < self.max_iter and abs(current) > 0 and abs((current - previous) / current) >= self.tol:
            previous = current
            hv = torch.autograd.grad(grads, params, grad_outputs=v, only_inputs=True, retain_graph=True)
            hv = [self.nan_to_num(h).float() for h in hv]
            current = self.inner_product(hv, v).item()
            v = [x / scale for x in self.normalize(hv)]
            i += 1
        if self.verbose:
            logger.info(f"eigenvalue: {i} power iterations, eigenvalue {current * scale}")
        return current * scale

    def compute_eigenvalue(self, module: torch.nn.Module, device: Optional[torch.device] = None,
                           scale: float = 1.0) -> dict:
        layers = self.get_layers(module)
        values, keys = [], []
        for b in range(self.layer_num):
            value = self._block(layers[b], device, scale)
            if value is None:
                logger.warning("eigenvalue: the model's gradients carry no graph (backward without create_graph, "
                               "or kernels without second derivatives): no eigenvalues")
                return {}
            values.append(value)
            keys.append([id(p) for p in layers[b].parameters()])
        values = self.post_process(values)
        return {k: (value, b) for b, (ks, value) in enumerate(zip(keys, values)) for k in ks}

    @staticmethod
    def post_process(values: list[float]) -> list[float]:
        top = abs(max(values, key=abs))
        return [abs(v) / top if v != 0.0 else 1.0 for v in values]
