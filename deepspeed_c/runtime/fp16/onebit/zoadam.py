"""0/1 Adam (Lu et al. 2022, https://arxiv.org/abs/2202.06009), DeepSpeed's ZeroOneAdam.

Semantics (DeepSpeed 0.19.6's), after a first step() that only creates the state:
  * variance phase (step <= var_freeze_step): on steps where step % var_interval == 0 the engine has
    all-reduced the gradients and both moments take them; on the other steps the local gradient's
    compressed average (1-bit, error feedback) updates the momentum only. Each variance update
    counts; after var_update_scaler of them the interval doubles. The engine's all-reduce is on
    exactly for the steps where (step + 1) % var_interval == 0.
  * frozen phase (after var_freeze_step; error buffers zeroed once): local steps with the local
    gradient, the applied updates accumulated (and the learning rates summed in lrs); every
    local_step_interval steps the ranks synchronise: the accumulated move, mapped back through the
    frozen denominator, is exchanged compressed; it becomes the new momentum (-move / lrs) and the
    parameters take the averaged move instead of their local ones. After local_step_scaler local
    steps the interval doubles, up to local_step_clipper.
update = m / (sqrt(v) + eps) (+ weight_decay * p), no bias correction. Momentum masks apply after
each exchange. With one rank nothing is exchanged and, as in DeepSpeed, the momentum does not
move on the variance phase's compressed steps."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepspeed_c.runtime.fp16.onebit.base import OnebitOptimizer

_POLICY = dict(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)


class ZeroOneAdam(OnebitOptimizer):
    """Implements the 0/1 Adam algorithm (DeepSpeed's arguments and defaults; see module docstring)."""

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0., max_grad_norm: float = 0., var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        if amsgrad:
            raise RuntimeError("0/1 Adam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.freeze_key = False
        self.reinitial_error_buffer = False
        self.initialize = False
        self._setup_comm(deepspeed, comm_backend_name, cuda_aware)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for key, value in _POLICY.items():
            state.setdefault(key, value)
        if "momentum_accumulator" not in state:
            state["momentum_accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = list(self.with_grads(self.param_groups, grads, "0/1 Adam"))
        for _, p, _ in work:
            self._init_state(p)["step"] += 1
        if not self.initialize:
            self.initialize = True  # the set-up step: no update (see OnebitAdam)
            self.freeze_key = False
            return loss

        # moments
        compressed = []
        for group, p, g in work:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            if self.freeze_key:
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["lrs"] += group["lr"]
            elif state["step"] % state["var_interval"] == 0:
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            elif self.size > 1:
                compressed.append((group, p, g.float().clone()))
        if compressed:
            onebit = [g for _, _, g in compressed]
            self.compressed_average_("errors", onebit)
            for (group, p, _), g in zip(compressed, onebit):
                self.apply_mask_(group, g)
                self.state[p]["exp_avg"].mul_(group["betas"][0]).add_(g, alpha=1 - group["betas"][0])

        # updates; in the frozen phase the applied moves accumulate for the next synchronisation
        syncing = []
        for group, p, _ in work:
            state = self.state[p]
            update = self.apply_adam_update_(group, p, state, self.freeze_key)
            if self.freeze_key:
                state["momentum_accumulator"].add_(update, alpha=-group["lr"])
                if state["step"] % state["local_step_interval"] == 0:
                    syncing.append((group, p))
        if syncing:
            self._synchronise(syncing)

        # the variance / local-step policy
        for group, p, _ in work:
            state = self.state[p]
            if not self.freeze_key:
                if state["step"] % state["var_interval"] == 0:
                    state["var_counter"] += 1
                    if state["var_counter"] == self.var_update_scaler:
                        state["var_counter"] = 0
                        state["var_interval"] *= 2
                self.set_engine_allreduce((state["step"] + 1) % state["var_interval"] == 0)
            else:
                state["local_step_counter"] += 1
                if state["local_step_counter"] == self.local_step_scaler:
                    state["local_step_counter"] = 0
                    state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)

        if self.first_state().get("step", 0) > self.var_freeze_step:
            self.freeze_key = True
            self.set_engine_allreduce(False)
        if self.freeze_key and not self.reinitial_error_buffer:
            self.reset_compression_errors()  # the momentum exchange starts from zero errors
            self.reinitial_error_buffer = True
        return loss

    def _synchronise(self, syncing: list) -> None:
        buffers = []
        for group, p in syncing:
            state = self.state[p]
            acc = state["momentum_accumulator"]
            p.sub_(acc.to(p.dtype))  # undo the local moves since the last synchronisation
            acc.mul_(self.denominator(p, state["exp_avg_sq"], group["eps"]))
            buffers.append(acc)
        self.compressed_average_("errors", buffers)
        for group, p in syncing:
            state = self.state[p]
            acc = state["momentum_accumulator"]
            self.apply_mask_(group, acc)
            state["exp_avg"].zero_().add_(acc / state["lrs"], alpha=-1)
            p.add_((acc / self.denominator(p, state["exp_avg_sq"], group["eps"])).to(p.dtype))
            acc.zero_()
            state["lrs"] = 0.0

    # -- the rank's own state (fp16/onebit/rank_state.py) -----------------------------------------
    _LOCAL = ("param", "exp_avg", "momentum_accumulator")

    def _stepped(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if "momentum_accumulator" in self.state.get(p, {})]

    def local_rank_state(self) -> dict:
        """In the frozen phase each rank moves its parameters and momentum with its own gradients
        between two synchronisations, and accumulates its moves and learning rates: those values,
        per stepped parameter in order (rank 0's alone are in the shared files)."""
        if not self.freeze_key:
            return {}
        out = []
        for p in self._stepped():
            state = self.state[p]
            out.append({"param": p.detach().cpu(), "exp_avg": state["exp_avg"].detach().cpu(),
                        "momentum_accumulator": state["momentum_accumulator"].detach().cpu(),
                        "lrs": float(state["lrs"])})
        return {"local_steps": out}

    def local_rank_state_mismatch(self, state: dict) -> Optional[str]:
        if not state:
            return "the checkpoint has no local-step state, this run is in the frozen phase" if self.freeze_key \
                else None
        if not self.freeze_key:
            return "the checkpoint holds local-step state, this run loaded a step before the frozen phase"
        saved = state.get("local_steps")
        params = self._stepped()
        if not isinstance(saved, list) or len(saved) != len(params):
            return (f"local-step state for {len(saved) if isinstance(saved, list) else 0} parameters, "
                    f"this optimizer steps {len(params)}")
        for i, (p, entry) in enumerate(zip(params, saved)):
            for key in self._LOCAL:
                t = entry.get(key) if isinstance(entry, dict) else None
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    found = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    return f"parameter {i}'s {key} is {found}, the parameter is {tuple(p.shape)}"
            if not isinstance(entry.get("lrs"), float):
                return f"parameter {i}'s lrs is {type(entry.get('lrs')).__name__}, expected float"
        return None

    @torch.no_grad()
    def load_local_rank_state(self, state: dict) -> None:
        for p, entry in zip(self._stepped(), state.get("local_steps", [])):
            s = self.state[p]
            p.copy_(entry["param"])
            s["exp_avg"].copy_(entry["exp_avg"])
            s["momentum_accumulator"].copy_(entry["momentum_accumulator"])
            s["lrs"] = entry["lrs"]

    def load_state_dict(self, state_dict: dict) -> None:
        """Moments, counters and the variance / local-step policy as saved. The engine's all-reduce
        follows the loaded step (DeepSpeed's rule); error buffers restart at zero, and so does the
        move accumulated since the last synchronisation (the loaded weights are rank 0's), until the
        checkpoint's rank files restore this rank's own (load_rank_checkpoint_file)."""
        super().load_state_dict(self._prepare_state_dict(state_dict))
        state = self.first_state()
        step = state.get("step", 0)
        self.freeze_key = step > self.var_freeze_step
        if step < self.var_freeze_step:
            self.set_engine_allreduce((step + 1) % state.get("var_interval", 1) == 0)
        else:
            self.set_engine_allreduce(False)
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state.get(p)
                if s and "momentum_accumulator" in s:
                    s["momentum_accumulator"].zero_()
                    s["lrs"] = 0.0
        self.reinitial_error_buffer = self.freeze_key
        self.initialize = step > 0
        self.reset_compression_errors()
