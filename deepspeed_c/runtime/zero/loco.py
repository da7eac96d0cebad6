"""LoCo-Zero++ (`zero_optimization.zeropp_loco_param: {"err_beta", "reset_T"}`, DeepSpeed 0.19.6; removed in
0.19.8): error feedback for qgZ's int4 gradient all-to-alls.

Quantizing a gradient to int4 every step loses the same rounding error again and again; LoCo carries it into
the next step's quantization instead. For each quantized hop of each bucket this rank keeps an error buffer e
(stored as int8 codes with block scales, as DeepSpeed stores it): the sent values are q = Q4(x + e), and
e <- err_beta * e + (1 - err_beta) * ((x + e) - deQ4(q)). Every reset_T uses of a buffer it starts again from
zero. A buffer's key is its bucket's place in the backward (the n-th quantized reduce of a round: the
stage-3 optimizer ends each round), so the same bucket meets its own error every step and in a resumed
run. The numbers differ from plain qgZ's (within the tolerance the tests state) and the error buffers are
per-rank checkpoint state.""" 
from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional

import torch

from deepspeed_c.ops.quantizer import dequantize, quantize

ERROR_BITS = 8


class LocoErrorFeedback:
    def __init__(self, err_beta: float, reset_T: int, block: int) -> None:
        self.err_beta = float(err_beta)
        self.reset_T = int(reset_T)
        self.block = block
        self._errors: dict[Hashable, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._uses: dict[Hashable, int] = {}

    @classmethod
    def from_config(cls, section: Optional[Mapping[str, Any]], block: int) -> Optional["LocoErrorFeedback"]:
        """zeropp_loco_param parsed (None: LoCo off). Bad values raise naming the key."""
        if section is None:
            return None
        if not isinstance(section, Mapping):
            raise ValueError(f"zero_optimization.zeropp_loco_param must be a dict, got {type(section).__name__}")
        unknown = sorted(set(section) - {"err_beta", "reset_T"})
        if unknown:
            raise ValueError(f"zero_optimization.zeropp_loco_param: unknown keys {unknown} (valid: err_beta, reset_T)")
        beta, reset = section.get("err_beta", 0.8), section.get("reset_T", 1024)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"zero_optimization.zeropp_loco_param.err_beta must be in [0, 1], got {beta!r}")
        if isinstance(reset, bool) or not isinstance(reset, int) or reset < 1:
            raise ValueError(f"zero_optimization.zeropp_loco_param.reset_T must be a positive int, got {reset!r}")
        return cls(beta, reset, block)

    def _error(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        uses = self._uses.get(key, 0) + 1
        self._uses[key] = uses
        stored = self._errors.get(key)
        if stored is None or stored[2] != x.numel() or uses > self.reset_T:
            self._uses[key] = 1
            return torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        q, s, n = stored
        return dequantize(q, s, n, ERROR_BITS, self.block)

    @torch.no_grad()
    def quantize(self, key: Hashable, x: torch.Tensor, bits: int, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of x + e for the all-to-all, the error buffer of `key` updated."""
        e = self._error(key, x)
        comp = x.reshape(-1).float() + e
        q, s = quantize(comp.to(x.dtype).contiguous(), bits, self.block, segments)
        new = comp - dequantize(q, s, x.numel(), bits, self.block, segments)
        e.mul_(self.err_beta).add_(new, alpha=1.0 - self.err_beta)
        self._errors[key] = (*quantize(e.contiguous(), ERROR_BITS, self.block), x.numel())
        return q, s

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (int8 codes and scales) and their use counts, by key."""
        keys = list(self._errors)
        return {"keys": [list(k) for k in keys], "codes": [self._errors[k][0].cpu() for k in keys],
                "scales": [self._errors[k][1].cpu() for k in keys], "numel": [self._errors[k][2] for k in keys],
                "uses": [self._uses.get(k, 0) for k in keys]}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        self._errors, self._uses = {}, {}
        for k, q, s, n, u in zip(state["keys"], state["codes"], state["scales"], state["numel"], state["uses"]):
            self._errors[tuple(k)] = (q.to(device), s.to(device), int(n))
            self._uses[tuple(k)] = int(u)
