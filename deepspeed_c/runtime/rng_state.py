"""This process's random number generators as one stateful object: a checkpoint carries them per rank
so a resumed run draws the same dropout masks (and anything else random) as the uninterrupted one.

DeepSpeed's engine saves no RNG state; Megatron-DeepSpeed keeps it in its client state under these key
names (`random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state`, `rng_tracker_states`),
which this file follows so the per-rank payloads read the same."""
from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch

KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _tracker() -> Any:
    """The activation-checkpointing model-parallel RNG tracker (its named CUDA streams), or None."""
    try:
        from deepspeed_c.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStates:
    """Python's, numpy's, torch's CPU and (when CUDA is in use) the current device's generator, plus the
    activation-checkpointing tracker's named states."""

    def state_dict(self) -> dict[str, Any]:
        tracker = _tracker()
        version, inner, gauss = random.getstate()
        np_state = np.random.get_state()
        return {
            # tuples of ints: plain data, so the checkpoint stays loadable with weights_only
            "random_rng_state": [version, list(inner), gauss],
            "np_rng_state": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).copy()), int(np_state[2]),
                             int(np_state[3]), float(np_state[4])],
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if _cuda_ready() else None,
            "rng_tracker_states": tracker.get_states() if tracker is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("random_rng_state", "np_rng_state", "torch_rng_state") if k not in state]
        if missing:
            raise KeyError(f"RNG state is missing {missing} (has {sorted(state)})")
        version, inner, gauss = state["random_rng_state"]
        random.setstate((version, tuple(inner), gauss))
        name, keys, pos, has_gauss, cached = state["np_rng_state"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((name, keys.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
        torch.set_rng_state(state["torch_rng_state"])
        if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng_state"])
        tracker = _tracker()
        if tracker is not None and state.get("rng_tracker_states") is not None:
            tracker.set_states(state["rng_tracker_states"])
