"""MuonWithAuxAdam: Muon for the param groups flagged `use_muon`, Adam for the others (DeepSpeed 0.19.8's
`deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam`, the optimizer built for `optimizer.type`
"Muon").

Muon group (defaults lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"), per matrix W with gradient G:
    M <- momentum * M + (1 - momentum) * G;   U <- (1 - momentum) * G + momentum * M   (Nesterov)
    O <- NewtonSchulz(U) * sqrt(max(1, rows / cols));   W <- W * (1 - lr * weight_decay) - lr * O
Adam group (defaults lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0), decoupled decay, bias-corrected
moments, eps added outside the square root.

Where the step sees whole parameters (no ZeRO, or the fp32 masters of the mixed-precision optimizer) it
runs the update on them, Newton-Schulz batched by shape. Under ZeRO 1/2/3 the group's only parameter is
the rank's flat partition: momentum stays partitioned and the blended update is exchanged so that one
rank orthogonalises each whole matrix (partitioned.PartitionedMuon). The partition's layout comes through
`bind_partition`, or is looked up on first use from the ZeRO optimizer that owns the group's parameters.

Differences from DeepSpeed 0.19.8, all where DeepSpeed's result is not Muon's: at ZeRO stage 0 DeepSpeed's
engine-built optimizer applies the raw gradient to Muon parameters (its orthogonalisation lives in the ZeRO
optimizers), here stage 0 runs Muon; under fp16 DeepSpeed feeds the loss-scaled gradient into the momentum
and gradient clipping scales the orthogonalised update, here momentum gets the unscaled, clipped gradient;
at stage 3 DeepSpeed orthogonalises at every micro-step's reduction, here once per optimizer step."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.zero.muon.newton_schulz import NS_METHODS, orthogonalize_many
from deepspeed_c.runtime.zero.muon.partitioned import PartitionedMuon, PartitionLayout, layout_from_zero_owner

MUON_DEFAULTS = dict(lr=0.02, momentum=0.95, weight_decay=0.0, ns_method="gram")
ADAM_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)


def _check_group(k: int, group: dict[str, Any]) -> None:
    if "use_muon" not in group:
        raise ValueError(f"MuonWithAuxAdam: param group {k} has no 'use_muon' flag; give every group use_muon=True "
                         f"(matrices, Muon) or use_muon=False (Adam)")
    if group["use_muon"] and group["params"] and all(p.ndim < 2 for p in group["params"]):
        # nothing to orthogonalise: the group is an Adam group, as DeepSpeed's flags make every 1-D parameter
        from deepspeed_c.utils.logging import logger

        logger.warning(f"MuonWithAuxAdam: param group {k} has use_muon=True but only 1-D parameters; it takes the "
                       f"auxiliary Adam step")
        group["use_muon"] = False
    defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
    for key, value in defaults.items():
        group.setdefault(key, value)
    if group["use_muon"]:
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"MuonWithAuxAdam: param group {k}: ns_method must be one of {list(NS_METHODS)}, "
                             f"got {group['ns_method']!r}")
        if not 0.0 <= float(group["momentum"]) < 1.0:
            raise ValueError(f"MuonWithAuxAdam: param group {k}: momentum must be in [0, 1), got {group['momentum']}")
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(f"MuonWithAuxAdam: param group {k} has use_muon=True but holds a parameter of shape "
                                 f"{tuple(p.shape)}; Muon needs ndim >= 2: put it in a use_muon=False group")
        # DeepSpeed orders a Muon group largest first (its ZeRO layout and checkpoints follow this order)
        group["params"] = sorted(group["params"], key=lambda p: p.size(), reverse=True)
    else:
        betas = group["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ValueError(f"MuonWithAuxAdam: param group {k}: betas must be two numbers, got {betas!r}")
    for key in ("lr", "weight_decay"):
        if float(group[key]) < 0.0:
            raise ValueError(f"MuonWithAuxAdam: param group {k}: {key} must be >= 0, got {group[key]}")


class MuonWithAuxAdam(torch.optim.Optimizer):
    """param_groups: dicts with `params` and `use_muon`, plus the hyperparameters of their kind."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        groups = [dict(g) for g in param_groups]
        if not groups:
            raise ValueError("MuonWithAuxAdam: no param groups")
        for k, group in enumerate(groups):
            group["params"] = list(group["params"])
            _check_group(k, group)
        super().__init__(groups, dict())
        # the whole parameters the groups were built over (ZeRO later swaps them for its flat partitions; MoE may
        # split the groups first)
        self._model_params = [list(g["params"]) for g in self.param_groups]
        self._bindings: dict[int, tuple[torch.Tensor, PartitionedMuon]] = {}

    def bind_partition(self, group_index: int, layout: PartitionLayout) -> None:
        """The seam for a partitioning optimizer: group `group_index`, whose only parameter is now one flat
        partition, is cut as `layout` says (without it, the layout is read on first use from the ZeRO optimizer
        that holds the partition)."""
        flat = self.param_groups[group_index]["params"][0]
        self._bindings[id(flat)] = (flat, PartitionedMuon.from_layout(layout, flat.device))

    def _binding(self, k: int, flat: torch.Tensor) -> PartitionedMuon:
        # keyed by the partition tensor, not the group's index: MoE's ZeRO members each step a shallow copy
        # of this optimizer holding a subset of its groups (sharing this dict)
        entry = self._bindings.get(id(flat))
        if entry is None or entry[0] is not flat:
            layout = layout_from_zero_owner([p for params in self._model_params for p in params], flat)
            if layout is None:
                raise RuntimeError(f"MuonWithAuxAdam: param group {k} (use_muon=True) holds a 1-D tensor of "
                                   f"{flat.numel()} elements that no ZeRO optimizer owns; Muon needs the whole "
                                   f"matrices, or a partition layout given through bind_partition()")
            entry = self._bindings[id(flat)] = (flat, PartitionedMuon.from_layout(layout, flat.device))
        return entry[1]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for k, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            if not group["use_muon"]:
                self._adam(group)
            elif any(p.ndim < 2 for p in group["params"]):  # a ZeRO partition stands for the matrices
                self._muon_partition(k, group)
            else:
                self._muon_whole(group)
        return loss

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        # a parameter without a gradient steps on zeros, as DeepSpeed's (its momentum keeps moving it)
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    @staticmethod
    def _trainable(group: dict[str, Any]) -> list[torch.Tensor]:
        # a frozen parameter in a user's group is left alone (DeepSpeed's engine never groups one; weight
        # decay would otherwise shrink it)
        return [p for p in group["params"] if p.requires_grad]

    def _momentum(self, params: list[torch.Tensor], grads: list[torch.Tensor], beta: float) -> list[torch.Tensor]:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, grads, 1.0 - beta)
        return torch._foreach_lerp(grads, bufs, beta)  # Nesterov

    def _apply(self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict[str, Any]) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_add_(params, updates, alpha=-lr)

    def _muon_whole(self, group: dict[str, Any]) -> None:
        params = self._trainable(group)
        if not params:
            return
        blended = self._momentum(params, self._grads(params), float(group["momentum"]))
        ortho = orthogonalize_many(blended, [tuple(p.shape) for p in params], group["ns_method"],
                                   expert=[bool(getattr(p, "is_expert_group", False)) for p in params])
        self._apply(params, ortho, group)

    def _muon_partition(self, k: int, group: dict[str, Any]) -> None:
        if len(group["params"]) != 1:
            raise RuntimeError(f"MuonWithAuxAdam: param group {k} (use_muon=True) mixes 1-D tensors and matrices")
        flat = group["params"][0]
        binding = self._binding(k, flat)
        blended = self._momentum([flat], self._grads([flat]), float(group["momentum"]))[0]
        self._apply([flat], [binding.orthogonalize(blended, group["ns_method"])], group)

    def _adam(self, group: dict[str, Any]) -> None:
        """Multi-tensor passes over the parameters that share a step count (all of them, but for parameters
        added to the group later)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        by_step: dict[int, list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]] = {}
        trainable = self._trainable(group)
        for p, g in zip(trainable, self._grads(trainable)):
            state = self.state[p]
            if "step" not in state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] = 0
            state["step"] += 1
            by_step.setdefault(int(state["step"]), []).append((p, g, state))
        for t, items in by_step.items():
            params = [p for p, _, _ in items]
            grads = [g for _, g, _ in items]
            exp_avg = [s["exp_avg"] for _, _, s in items]
            exp_avg_sq = [s["exp_avg_sq"] for _, _, s in items]
            torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
            torch._foreach_lerp_(exp_avg_sq, torch._foreach_mul(grads, grads), 1.0 - beta2)
            denom = torch._foreach_div(exp_avg_sq, 1.0 - beta2 ** t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(exp_avg, 1.0 - beta1 ** t)
            torch._foreach_div_(update, denom)
            self._apply(params, update, group)
