"""What the three 1-bit optimizers share: the communication backend their `comm_backend_name`
picks, the data-parallel world they compress over, the engine's gradient all-reduce switch (they
communicate themselves once compression starts, as DeepSpeed's), momentum masks, and the
checkpoint rules (the mask in a checkpoint never replaces the one the script gave; each rank's
compression errors go to a file of its own, see below).

Error buffers live in the compressed all-reduce plans (runtime/comm/compressed.SignAllreduce),
not in the optimizer's `state`: the shared optimizer state (rank 0's, in the model-states file)
holds exp_avg / exp_avg_sq / step (and 0/1 Adam's and 1-bit LAMB's policy fields) only, and
load_state_dict resets the errors as DeepSpeed's does. Each rank also writes its errors (and 0/1
Adam's local steps) to onebit_errors_rank_R_of_W.pt in the tag directory; the engine's
checkpointer hands that file back after load_state_dict, and with the same world it restores
them, so a resumed run continues exactly as an uninterrupted one (rank_state.py). A DeepSpeed
checkpoint's worker_error / server_error entries are dropped on load."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from deepspeed_c.runtime.comm.compressed import CompressedBackend, SignAllreduce, comm_backend

_DROPPED_ON_LOAD = ("worker_error", "server_error", "tensor_size", "corrected_tensor_size", "server_chunk_size")


def data_parallel_world(deepspeed: Any) -> tuple[Any, int]:
    """(group, size) the optimizer compresses over: the engine's data-parallel group when it has an
    mpu, else the whole world (1 when torch.distributed is not initialised)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return None, 1
    mpu = getattr(deepspeed, "mpu", None)
    group = mpu.get_data_parallel_group() if mpu is not None else None
    return group, tdist.get_world_size(group=group)


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of OnebitAdam, ZeroOneAdam and OnebitLamb (not an optimizer by itself)."""

    def _setup_comm(self, deepspeed: Any, comm_backend_name: str, cuda_aware: bool) -> None:
        self.deepspeed = deepspeed
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        # a pipeline engine keeps its own switch (DeepSpeed's pipeline_enable_backward_allreduce)
        self.using_pipeline = hasattr(deepspeed, "pipeline_enable_backward_allreduce")
        _, self.size = data_parallel_world(deepspeed)
        self.comm_backend_handle: Optional[CompressedBackend] = None
        if self.size > 1 or comm_backend_name not in ("nccl", "compressed"):
            self.comm_backend_handle = comm_backend(comm_backend_name, getattr(deepspeed, "mpu", None), cuda_aware)
        self._plans: dict[tuple, SignAllreduce] = {}

    def set_engine_allreduce(self, enabled: bool) -> None:
        """Turns the engine's data-parallel gradient all-reduce on or off (DeepSpeed's optimizers flip
        `enable_backward_allreduce` on the engine they are given)."""
        if self.deepspeed is None:
            return
        if self.using_pipeline:
            self.deepspeed.pipeline_enable_backward_allreduce = enabled
        else:
            self.deepspeed.enable_backward_allreduce = enabled

    def plan_for(self, key: str, tensors: Sequence[torch.Tensor], persistent_pad: bool = False) -> SignAllreduce:
        """The compressed all-reduce (with its error buffers) of this list of tensors; a new plan,
        errors at zero, when the list changes."""
        return self.plan_of(key, [t.numel() for t in tensors], tensors[0].device if tensors else None, persistent_pad)

    def plan_of(self, key: str, numels: Sequence[int], device: Optional[torch.device],
                persistent_pad: bool = False) -> SignAllreduce:
        """plan_for by sizes and device (a checkpoint's rank file rebuilds its plans so)."""
        full_key = (key, tuple(int(n) for n in numels), str(device) if device is not None else "")
        plan = self._plans.get(full_key)
        if plan is None:
            assert self.comm_backend_handle is not None
            plan = self.comm_backend_handle.plan(list(full_key[1]), device, persistent_pad=persistent_pad)
            self._plans = {k: v for k, v in self._plans.items() if k[0] != key}
            self._plans[full_key] = plan
        return plan

    def compression_plans(self) -> list[tuple[str, SignAllreduce]]:
        """(key, plan) of every compressed all-reduce holding error buffers now."""
        return [(k[0], plan) for k, plan in self._plans.items()]

    def adopt_plans(self, plans: Sequence[tuple[str, SignAllreduce]]) -> None:
        """Installs plans (a checkpoint's, restored) under the keys plan_for looks them up by."""
        for key, plan in plans:
            self._plans = {k: v for k, v in self._plans.items() if k[0] != key}
            self._plans[(key, tuple(plan.numels), str(plan.device))] = plan

    def reset_compression_errors(self) -> None:
        """Drops every error buffer (they restart at zero): on checkpoint load (until the rank's own
        file restores them, rank_state.py), and where DeepSpeed re-initialises them."""
        self._plans = {}
        self.forget_denominators()

    def compressed_average_(self, key: str, tensors: list[torch.Tensor], persistent_pad: bool = False) -> None:
        """In place: each tensor becomes the compressed average over the data-parallel ranks."""
        if not tensors or self.size <= 1:
            return
        plan = self.plan_for(key, tensors, persistent_pad)
        flat = [t if t.dtype == torch.float32 and t.is_contiguous() else t.detach().float().contiguous()
                for t in tensors]
        plan(flat)
        for t, f in zip(tensors, flat):
            if f is not t:
                t.copy_(f)

    def denominator(self, p: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float) -> torch.Tensor:
        """sqrt(exp_avg_sq) + eps, kept while exp_avg_sq is unchanged (the variance is frozen once
        compression starts, so the same tensor serves every later step: one pass saved per step)."""
        cache = self.__dict__.setdefault("_denominators", {})
        hit = cache.get(id(p))
        if hit is not None and hit[0] is exp_avg_sq and hit[1] == exp_avg_sq._version and hit[2] == eps:
            return hit[3]
        denom = exp_avg_sq.sqrt().add_(eps)
        cache[id(p)] = (exp_avg_sq, exp_avg_sq._version, eps, denom)
        return denom

    def apply_adam_update_(self, group: dict, p: torch.Tensor, state: dict, frozen: bool) -> torch.Tensor:
        """Moves p by -lr x (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay x p), DeepSpeed's update without
        bias correction (the denominator cached while the variance is frozen); returns the update."""
        if frozen:
            update = state["exp_avg"] / self.denominator(p, state["exp_avg_sq"], group["eps"])
        else:
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update.add_(p.detach(), alpha=group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])
        return update

    def forget_denominators(self) -> None:
        self.__dict__.pop("_denominators", None)

    @staticmethod
    def apply_mask_(group: dict, tensor: torch.Tensor) -> None:
        """Momentum masks: 1-bit codes have no zero, so entries that must stay zero (padding rows
        a model never trains) are multiplied by the group's `exp_avg_mask` after each exchange."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        if mask.device != tensor.device:
            group["exp_avg_mask"] = mask = mask.to(tensor.device)
        if mask.shape != tensor.shape and mask.numel() == tensor.numel():
            # DeepSpeed's examples flatten the mask (its 1-bit momentum is flat once compression starts); the
            # group keeps the mask as given (a checkpoint holds it so)
            mask = mask.view(tensor.shape)
        tensor.mul_(mask)

    @staticmethod
    def grads_by_group(param_groups: list[dict], grads: Any) -> list[list[Optional[torch.Tensor]]]:
        """DeepSpeed's optional `grads` argument of step(): one list per group, or one list for a
        single group; None means each param's .grad."""
        if grads is None:
            return [[None] * len(g["params"]) for g in param_groups]
        grads = list(grads) if not isinstance(grads, list) else grads
        if grads and not isinstance(grads[0], (list, tuple)):
            grads = [grads]
        return [list(g) for g in grads]

    @staticmethod
    def with_grads(param_groups: list[dict], grads: Any,
                   name: str) -> Iterable[tuple[dict, torch.Tensor, torch.Tensor]]:
        for group, group_grads in zip(param_groups, OnebitOptimizer.grads_by_group(param_groups, grads)):
            for p, g in zip(group["params"], group_grads):
                if g is None:
                    if p.grad is None:
                        continue
                    g = p.grad
                if g.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients")
                yield group, p, g.detach()

    # -- checkpoints ---------------------------------------------------------------------------
    def _prepare_state_dict(self, state_dict: dict) -> dict:
        """The masks the script gave win over the checkpoint's (DeepSpeed's rule: they may change
        between training phases); DeepSpeed's error-buffer entries are dropped."""
        state_dict = dict(state_dict)
        groups = [dict(g) for g in state_dict["param_groups"]]
        for mine, saved in zip(self.param_groups, groups):
            if "exp_avg_mask" in mine:
                saved["exp_avg_mask"] = mine["exp_avg_mask"]
            else:
                saved.pop("exp_avg_mask", None)
        state_dict["param_groups"] = groups
        state_dict["state"] = {k: {n: v for n, v in s.items() if n not in _DROPPED_ON_LOAD}
                               for k, s in state_dict["state"].items()}
        return state_dict

    def rank_checkpoint_file(self) -> tuple[str, dict]:
        """(file name, contents) of this rank's own state for the checkpoint's tag directory: the
        compression errors and whatever else differs between ranks (rank_state.py)."""
        from deepspeed_c.runtime.fp16.onebit import rank_state

        return rank_state.rank_file(self)

    def load_rank_checkpoint_file(self, tag_dir: str, manifest: Any) -> None:
        """After load_state_dict: this rank's file restores what rank_checkpoint_file saved when every
        rank of the group has one that fits; otherwise the reset load_state_dict did stands (DeepSpeed's
        semantics) and the group's rank 0 logs why. A collective over the data-parallel group."""
        from deepspeed_c.runtime.fp16.onebit import rank_state

        rank_state.restore(self, tag_dir, manifest)

    def local_rank_state(self) -> dict:
        """Per-parameter state besides the errors that differs between ranks (0/1 Adam's local steps)."""
        return {}

    def local_rank_state_mismatch(self, state: dict) -> Optional[str]:
        """Why local_rank_state's `state` cannot be restored here, or None."""
        return None if not state else "this optimizer keeps no local per-rank state"

    def load_local_rank_state(self, state: dict) -> None:
        """Restores local_rank_state's `state` (checked by local_rank_state_mismatch first)."""

    def first_state(self) -> dict:
        """The state of the first parameter that has one (DeepSpeed reads the step counter from the
        first parameter's; a frozen parameter never gets a state)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return state
        return {}
