"""deepspeed.runtime.rollout.base: the contract between an RL/distillation trainer and whatever generates its
on-policy samples.

A trainer hands a RolloutRequest (left-padded prompts) and a SamplingConfig to RolloutEngine.generate and gets a
RolloutBatch back (prompt and response in one tensor). Keeping the contract this small lets the trainer loop stay
ignorant of the backend (the hybrid engine here)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class RolloutConfig:
    """Which rollout backend build_rollout constructs, and its knobs."""
    engine: str = "hybrid_engine"
    use_graph_capture: bool = False  # CUDA-graph decode (greedy); not built in deepspeed_c


@dataclass
class SamplingConfig:
    """Per-step sampling settings. temperature <= 0 means greedy; top_k <= 0 means no top-k filter;
    continuous_batch_size (not None) selects the greedy continuous-batching path with that many rows."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        # DeepSpeed leaves these to fail deep inside generate; here a bad value names its field up front
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingConfig.max_new_tokens must be a positive int; got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"SamplingConfig.temperature must be a number (<= 0 for greedy); got "
                             f"{self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 <= float(self.top_p) <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in [0, 1]; got {self.top_p!r}")
        if not _is_int(self.top_k):
            raise ValueError(f"SamplingConfig.top_k must be an int (<= 0 disables top-k); got {self.top_k!r}")
        if not _is_int(self.n_samples_per_prompt) or self.n_samples_per_prompt < 1:
            raise ValueError(f"SamplingConfig.n_samples_per_prompt must be an int >= 1; got "
                             f"{self.n_samples_per_prompt!r}")
        cbs = self.continuous_batch_size
        if cbs is not None and (not _is_int(cbs) or cbs <= 0):
            raise ValueError(f"SamplingConfig.continuous_batch_size must be None or a positive int; got {cbs!r}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


@dataclass
class RolloutRequest:
    """Prompts for one generate call: prompt_ids [B, T_p], left-padded (real tokens flush right) so responses
    continue them; prompt_attention_mask [B, T_p], 1 on real tokens."""
    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"RolloutRequest.prompt_ids must be 2-D [batch, prompt_len]; got shape "
                             f"{_shape(self.prompt_ids)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"RolloutRequest.prompt_attention_mask shape {_shape(self.prompt_attention_mask)} "
                             f"does not match prompt_ids shape {_shape(self.prompt_ids)}")


@dataclass
class RolloutBatch:
    """What generate returns. input_ids [B', T]: each row its (left-padded) prompt then its response, right-padded
    to the batch's longest; B' = B * n_samples_per_prompt. attention_mask [B', T]; response_start_idx [B']: the
    column where each row's response starts."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"RolloutBatch.input_ids must be 2-D [batch, seq_len]; got shape "
                             f"{_shape(self.input_ids)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(f"RolloutBatch.attention_mask shape {_shape(self.attention_mask)} does not match "
                             f"input_ids shape {_shape(self.input_ids)}")
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows, ):
            raise ValueError(f"RolloutBatch.response_start_idx must be 1-D of length {rows} (one per row); got "
                             f"shape {_shape(self.response_start_idx)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A rollout backend: generate samples, take new weights, release resources."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Generates responses; returns prompt and response in one RolloutBatch."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Brings the backend's weights up to the trainer's after optimizer step `step` (a no-op for a backend
        that reads the training weights directly, as the hybrid engine does)."""

    def shutdown(self) -> None:
        """Releases backend resources; nothing to release by default."""
        return None
