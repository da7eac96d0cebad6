"""Counting by substitution: while a profile runs, the profiled torch.nn.functional functions and
torch / Tensor ops are replaced by wrappers that add the op's (flops, macs) to the innermost open
module frame and then call the original. `install` saves every original once; `restore` puts each
back, so after a profile ends torch is exactly as it was (the tests compare identities).

Frames are opened and closed by the profiler's module hooks (a stack, because modules nest: an
op counts toward the innermost module running it, and a parent's total sums its subtree)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from deepspeed_c.profiling.flops_profiler import counts

# one list of (flops, macs) per module forward in progress, innermost last
frames: list[list[tuple[int, int]]] = []

_POOLS = [f"{kind}_pool{d}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max") for d in (1, 2, 3)]

_FUNCTIONAL: list[tuple[str, Callable[..., counts.Counts]]] = (
    [("linear", counts.linear)]
    + [(f"conv{d}d", counts.conv) for d in (1, 2, 3)]
    + [(f"conv_transpose{d}d", counts.conv_transpose) for d in (1, 2, 3)]
    + [(name, counts.per_element) for name in ("relu", "prelu", "elu", "leaky_relu", "relu6", "silu", "gelu")]
    + [("batch_norm", counts.batch_norm), ("layer_norm", counts.layer_norm),
       ("instance_norm", counts.instance_norm), ("group_norm", counts.group_norm)]
    + [(name, counts.per_element) for name in _POOLS]
    + [("upsample", counts.upsample), ("interpolate", counts.upsample),
       ("softmax", counts.per_element), ("embedding", counts.free),
       ("scaled_dot_product_attention", counts.attention)])

_TORCH: list[tuple[str, Callable[..., counts.Counts]]] = [
    ("matmul", counts.matmul), ("mm", counts.matmul), ("bmm", counts.matmul), ("addmm", counts.addmm),
    ("mul", counts.elementwise), ("add", counts.elementwise), ("einsum", counts.einsum),
    ("baddbmm", counts.addmm)]

_TENSOR: list[tuple[str, Callable[..., counts.Counts]]] = [
    ("matmul", counts.matmul), ("__matmul__", counts.matmul), ("mm", counts.matmul), ("bmm", counts.matmul),
    ("addmm", counts.addmm), ("mul", counts.elementwise), ("add", counts.elementwise)]

# (owner, attribute) -> (owner, attribute, original, whether the owner itself defined it), while installed
_saved: dict[tuple[int, str], tuple[Any, str, Any, bool]] = {}


def _counting(original: Callable[..., Any], counter: Callable[..., counts.Counts]) -> Callable[..., Any]:

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if frames:
            # appended, not summed in place: under torch.compile the counts may be symbolic and
            # Dynamo cannot guard on a list element rewritten with one
            frames[-1].append(counter(*args, **kwargs))
        return original(*args, **kwargs)

    wrapper.__dsc_counting__ = True  # type: ignore[attr-defined]
    return wrapper


def _targets() -> list[tuple[Any, str, Callable[..., counts.Counts]]]:
    out = [(F, name, c) for name, c in _FUNCTIONAL] + [(torch, name, c) for name, c in _TORCH]
    out += [(torch.Tensor, name, c) for name, c in _TENSOR]
    try:  # einops is optional; DeepSpeed counts its einsum when it is there
        import einops

        if hasattr(einops, "einsum"):
            out.append((einops, "einsum", counts.einops_einsum))
    except ImportError:
        pass
    return [(owner, name, c) for owner, name, c in out if hasattr(owner, name)]


def installed() -> bool:
    return bool(_saved)


def install() -> None:
    """Patch every profiled op (idempotent: a second profiler shares the same wrappers)."""
    if _saved:
        return
    for owner, name, counter in _targets():
        original = getattr(owner, name)
        own = name in vars(owner)  # Tensor inherits most methods from TensorBase: put none back on Tensor
        _saved[(id(owner), name)] = (owner, name, original, own)
        setattr(owner, name, _counting(original, counter))


def restore() -> None:
    """Put every original back and drop any frame left open by a forward that raised."""
    for owner, name, original, own in _saved.values():
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    _saved.clear()
    frames.clear()
