"""weights_only loading of checkpoint files, including the ones the real DeepSpeed writes.

DeepSpeed pickles a few of its own objects into its checkpoints: its loss scaler (ZeRO-1/2 files keep
the object itself), the ZeRO stage as an enum and per-parameter `fragment_address` records. Instead
of turning weights_only off (which would let a file execute any callable), those exact global names
are allow-listed and mapped to small stand-in classes defined here, so DeepSpeed need not be
installed and nothing else a file names is ever called. Imports only torch and the standard library."""
from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from typing import Any

import torch


class LossScalerStandIn:
    """What a DeepSpeed LossScaler object becomes on load: its attributes only. deepspeed_c writes its
    ZeRO files' loss scaler as one of these too, pickled under DeepSpeed's class name (checkpoint.ds_pickle),
    so DeepSpeed's unpickler builds its own LossScaler from the same attributes."""

    cur_scale: float = 1.0
    dynamic: bool = False

    def __init__(self, **attrs: Any) -> None:
        vars(self).update(attrs)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if isinstance(v, (int, float, bool, str, type(None)))}

    @property
    def loss_scale(self) -> float:
        return self.cur_scale


class DynamicLossScalerStandIn(LossScalerStandIn):
    """DeepSpeed's DynamicLossScaler (fp16 with dynamic loss scaling), attributes only."""

    dynamic: bool = True


class ZeroStageStandIn(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class FragmentAddressStandIn:
    numel: int
    start: int


# one stand-in per DeepSpeed name, so the table also tells ds_pickle which name each stand-in is written as
DEEPSPEED_GLOBALS: list[tuple[Any, str]] = [
    (LossScalerStandIn, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScalerStandIn, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageStandIn, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddressStandIn, "deepspeed.utils.tensor_fragment.fragment_address"),
]


class UntrustedPickleError(pickle.UnpicklingError):
    """A checkpoint file names a global that weights_only loading does not allow."""


def load(path: str, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) with DeepSpeed's few checkpoint classes allow-listed as
    stand-ins. A file that names any other global raises UntrustedPickleError (nothing is executed)."""
    try:
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "global" in text.lower() or "weights_only" in text:
            raise UntrustedPickleError(
                f"checkpoint file {path} refers to Python objects that are not allowed when loading with "
                f"weights_only=True (only tensors, containers and DeepSpeed's LossScaler, ZeroStageEnum and "
                f"fragment_address are): {_reason(text)}") from None
        raise


def _reason(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln]
    return (named or lines or ["<no detail>"])[0]


def scaler_state(obj: Any) -> dict[str, Any] | None:
    """A loss-scaler state dict from whatever a file holds: our dict form or DeepSpeed's object."""
    if obj is None or isinstance(obj, dict):
        return obj
    if isinstance(obj, LossScalerStandIn):
        # the attributes deepspeed_c's scalers restore; the rest (window, minimum) come from the config
        kept = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        return {k: v for k, v in obj.state_dict().items() if k in kept}
    raise TypeError(f"checkpoint loss_scaler has type {type(obj).__name__}; expected a dict or DeepSpeed's "
                    "LossScaler")
