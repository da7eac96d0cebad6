"""deepspeed.runtime.rollout.opsd: on-policy self-distillation (OPSD) pieces: the response-only causal targets of a
rollout (ResponseTokenBatch) and the generalized Jensen-Shannon divergence between student and teacher logits on
those tokens (generalized_jsd_loss), with the unreduced sum and token count a data-parallel trainer all-reduces."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from deepspeed_c.runtime.rollout.base import RolloutBatch


@dataclass(frozen=True)
class ResponseTokenBatch:
    """Causal targets of a rollout: logits at position i predict target_ids[:, i] = input_ids[:, i + 1];
    response_mask [B, T-1] is true where that target is a real response token."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> "ResponseTokenBatch":
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        if mask.device != ids.device:
            raise ValueError(f"rollout attention_mask is on {mask.device} but input_ids on {ids.device}: they must "
                             "be on the same device")
        if start.device != ids.device:
            raise ValueError(f"rollout response_start_idx is on {start.device} but input_ids on {ids.device}: they "
                             "must be on the same device")
        if start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rollout response_start_idx must use an integer dtype (int32 or int64); got {start.dtype}")
        seq_len = ids.shape[1]
        if bool(((start < 1) | (start > seq_len)).any()):
            raise ValueError(f"rollout response_start_idx must be in [1, sequence_length={seq_len}]; got "
                             f"{start.tolist()}")
        # target column j is token j + 1: it is a response target when j + 1 >= the row's response start
        target_pos = torch.arange(1, seq_len, device=ids.device)
        in_response = target_pos[None, :] >= start[:, None]
        return cls(input_ids=ids, attention_mask=mask, target_ids=ids[:, 1:],
                   response_mask=in_response & mask[:, 1:].bool())

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, T, V] of input_ids -> [B, T-1, V], aligned with target_ids and response_mask."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be 3-D [batch, sequence_length, vocabulary_size]; got shape "
                             f"{tuple(logits.shape)}")
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError(f"logits batch and sequence dimensions {tuple(logits.shape[:2])} must match input_ids "
                             f"{tuple(self.input_ids.shape)}")
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """loss = loss_sum / max(valid_token_count, 1); the sum and count let ranks reduce before dividing."""
    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def _check_jsd_args(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float,
                    temperature: float, teacher_top_k: Optional[int], pointwise_clip: Optional[float]) -> None:
    if student.dim() != 3 or student.shape != teacher.shape:
        raise ValueError(f"student_logits and teacher_logits must have matching 3-D shapes [batch, seq, vocab]; "
                         f"got {tuple(student.shape)} and {tuple(teacher.shape)}")
    if mask.shape != student.shape[:2]:
        raise ValueError(f"response_mask shape {tuple(mask.shape)} must match logits batch and sequence dimensions "
                         f"{tuple(student.shape[:2])}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1]; got {beta}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive; got {temperature}")
    if teacher_top_k is not None and teacher_top_k <= 0:
        raise ValueError(f"teacher_top_k must be positive when specified; got {teacher_top_k}")
    if teacher_top_k is not None and teacher_top_k > student.shape[-1]:
        raise ValueError(f"teacher_top_k ({teacher_top_k}) must not exceed the vocabulary size "
                         f"({student.shape[-1]})")
    if pointwise_clip is not None and pointwise_clip < 0.0:
        raise ValueError(f"pointwise_clip must be non-negative when specified; got {pointwise_clip}")


def _pointwise_divergence(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-vocabulary-entry terms of beta * KL(t || m) + (1 - beta) * KL(s || m), m = beta t + (1 - beta) s;
    the endpoints are the plain KLs (m is then t or s and one term vanishes)."""
    if beta == 0.0:
        return log_t.exp() * (log_t - log_s)  # forward KL(teacher || student)
    if beta == 1.0:
        return log_s.exp() * (log_s - log_t)  # reverse KL(student || teacher)
    # log m without leaving log space: logsumexp of the two weighted log-probabilities
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)


def generalized_jsd_loss(student_logits: torch.Tensor,
                         teacher_logits: torch.Tensor,
                         response_mask: torch.Tensor,
                         beta: float = 0.5,
                         temperature: float = 1.0,
                         teacher_top_k: Optional[int] = None,
                         pointwise_clip: Optional[float] = None) -> JSDLossOutput:
    """Generalized JSD averaged over the tokens where response_mask is true.

    Both logits are divided by `temperature`. beta 0 gives KL(teacher || student), beta 1 KL(student || teacher).
    teacher_top_k keeps, for both distributions, only the teacher's k most likely entries (renormalized over
    them). pointwise_clip caps each vocabulary entry's contribution before the per-token sum."""
    _check_jsd_args(student_logits, teacher_logits, response_mask, beta, temperature, teacher_top_k, pointwise_clip)
    s = student_logits / temperature
    t = teacher_logits / temperature
    if teacher_top_k is not None:
        keep = t.topk(teacher_top_k, dim=-1).indices
        s, t = s.gather(-1, keep), t.gather(-1, keep)
    terms = _pointwise_divergence(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), beta)
    if pointwise_clip is not None:
        terms = terms.clamp(max=pointwise_clip)
    weights = response_mask.to(terms.dtype)
    loss_sum = (terms.sum(-1) * weights).sum()
    count = weights.sum().long()
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)
