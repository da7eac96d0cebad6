"""`deepspeed.runtime.zero.unwrap_model_for_generation` (DeepSpeed 0.19.8 defines it in its stage3.py):
a ZeRO-3 model's weights gathered once for a generation loop, instead of a gather per module call."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from deepspeed_c.runtime.zero.partition_parameters import GatheredParameters


def _coordinator(model: Any) -> Optional[Any]:
    """The ZeRO-3 gather-on-use hooks of an engine: its optimizer's, or the stepper's of an engine built
    without an optimizer (inference)."""
    for holder in (getattr(model, "optimizer", None), getattr(model, "stepper", None)):
        coordinator = getattr(holder, "coordinator", None)
        if coordinator is not None:
            return coordinator
    return None


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yields `model` (a DeepSpeed engine) with every ZeRO-3 parameter gathered and ZeRO-3's module hooks
    off: each forward in the body runs on the full weights, none gathers or releases anything. On exit the
    hooks work again and the parameters are partitioned again; changes made to them in the body are
    dropped (GatheredParameters without modifier_rank). A model without ZeRO-3 passes through."""
    with GatheredParameters(list(model.parameters())):
        coordinator = _coordinator(model)
        with coordinator.hooks_off() if coordinator is not None else contextlib.nullcontext():
            yield model
