"""offload_optimizer.ratio < 1 under SuperOffload: the share of each param group's optimizer state that stays
on the device (DeepSpeed's `ratio` is the share offloaded). It is the group's first buckets, whole, so every
bucket's gather comes from one side: their fp32 masters and Adam moments live on the device and the fused
Adam steps them at the step (the C CPU Adam's update rule; on a CPU run the C kernel itself), writing the
model-dtype weights that go into the buckets' gathers. The host keeps the full-size master and state; the
device share is written into it whenever the optimizer's state is read as a whole (checkpoints: `to_host`)
and read back from it after a load (`from_host`)."""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch


class DeviceShare:

    def __init__(self, optimizer: Any, masters: Sequence[torch.Tensor], chunk_ranges: Sequence[Sequence[tuple[int, int]]],
                 ratio: float, device: torch.device, lp_dtypes: Sequence[torch.dtype]) -> None:
        self.optimizer = optimizer
        self.device = device
        self.lp_dtypes = list(lp_dtypes)
        self.buckets: list[int] = []  # per group: its first `buckets` buckets are stepped on the device
        self.cut: list[int] = []  # ... which end at this element of the partition
        for ranges, m in zip(chunk_ranges, masters):
            keep = (1.0 - float(ratio)) * m.numel()
            k = 0
            while k < len(ranges) and ranges[k][1] <= keep:
                k += 1
            self.buckets.append(k)
            self.cut.append(ranges[k - 1][1] if k else 0)
        self.master = [m.detach()[:c].to(device=device, dtype=torch.float32, copy=True) for m, c in zip(masters, self.cut)]
        self.moments = [{k: torch.zeros_like(dm) for k in optimizer.MOMENTS} for dm in self.master]
        self.steps = 0

    def active(self) -> bool:
        return any(self.cut)

    def on_device(self, g: int, end: int) -> bool:
        """Whether partition elements up to `end` of group g are the device's."""
        return end <= self.cut[g]

    @torch.no_grad()
    def step(self, coef: float, parts: Sequence[Optional[torch.Tensor]], gatherer: Any,
             ranges: Sequence[Sequence[tuple[int, int]]]) -> None:
        """The device share's Adam step with the unscaled, clipped gradient, and its buckets' gathers."""
        if not self.active():
            return
        self.steps += 1
        for g, dm in enumerate(self.master):
            cut = self.cut[g]
            if cut == 0:
                continue
            part = parts[g]
            grad = part[:cut].float() if part is not None else torch.zeros(cut, device=self.device)
            if coef != 1.0:
                grad = grad * coef  # a new tensor: part[:cut].float() may be the reduced partition itself
            group = self.optimizer.param_groups[g]
            beta1, beta2 = group["betas"]
            kw = dict(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                      weight_decay=float(group["weight_decay"]), step=self.steps,
                      bias_correction=bool(group.get("bias_correction", True)))
            adamw = bool(getattr(self.optimizer, "adam_w_mode", True))
            m, v = (self.moments[g][k] for k in self.optimizer.MOMENTS)
            if dm.is_cuda:
                from deepspeed_c.ops.adam.fused_adam import multi_tensor_adam

                multi_tensor_adam([grad], [dm], [m], [v], adam_w_mode=adamw, **kw)
            else:
                from deepspeed_c.ops.adam.cpu_adam import cpu_adam_step

                cpu_adam_step([dm], [grad], [m], [v], adamw_mode=adamw, **kw)
            lp = dm.to(self.lp_dtypes[g])
            for b in range(self.buckets[g]):
                start, end = ranges[g][b]
                gatherer.submit(g, b, lp[start:end])

    @torch.no_grad()
    def to_host(self, masters: Sequence[torch.Tensor]) -> None:
        """The device share into the host master and optimizer state (their first `cut` elements)."""
        for g, m, dm, cut in self._shares(masters):
            state = self.optimizer.ready_state(self.optimizer.param_groups[g], m, f"params[{g}][0]")
            m.detach()[:cut].copy_(dm)
            for k in self.optimizer.MOMENTS:
                state[k][:cut].copy_(self.moments[g][k])

    @torch.no_grad()
    def from_host(self, masters: Sequence[torch.Tensor]) -> None:
        """The device share re-read from the host master and state (after a load wrote them)."""
        for g, m, dm, cut in self._shares(masters):
            dm.copy_(m.detach()[:cut])
            state = self.optimizer.state.get(m, {})
            for k in self.optimizer.MOMENTS:
                if k in state:
                    self.moments[g][k].copy_(state[k][:cut])
            if "step" in state:
                self.steps = int(float(state["step"]))

    def _shares(self, masters: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, int]]:
        """(group, host master, device share, cut) of each group that keeps a device share."""
        if not self.active():
            return
        for g, (m, dm) in enumerate(zip(masters, self.master)):
            if self.cut[g]:
                yield g, m, dm, self.cut[g]
