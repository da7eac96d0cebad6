"""deepspeed.runtime.rollout.opsd: generalized_jsd_loss against a float64 reference written from the definition
(probabilities, not log-space tricks), forward and gradients for beta 0 / 0.3 / 0.5 / 1, temperature, teacher
top-k, pointwise clipping and masks; ResponseTokenBatch's shifted targets and mask; bad input naming the
argument."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from deepspeed_c.runtime.rollout import (JSDLossOutput, ResponseTokenBatch, RolloutBatch, generalized_jsd_loss)


def _reference(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, beta: float, temp: float,
               top_k: Optional[int], clip: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per token: beta * KL(q || m) + (1 - beta) * KL(p || m), m = beta q + (1 - beta) p, p student, q teacher,
    for 0 < beta < 1; KL(q || p) at beta 0 and KL(p || q) at beta 1; every quantity a plain float64 probability."""
    s, t = s.double() / temp, t.double() / temp
    if top_k is not None:
        idx = t.topk(top_k, dim=-1).indices
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    p = s.exp() / s.exp().sum(-1, keepdim=True)
    q = t.exp() / t.exp().sum(-1, keepdim=True)
    if beta == 0.0:  # DeepSpeed's endpoints are the plain KLs (the mixture form tends to 0 there)
        terms = q * (q / p).log()
    elif beta == 1.0:
        terms = p * (p / q).log()
    else:
        m = beta * q + (1 - beta) * p
        terms = beta * q * (q / m).log() + (1 - beta) * p * (p / m).log()
    if clip is not None:
        terms = terms.clamp(max=clip)
    per_token = terms.sum(-1)
    total = (per_token * mask.double()).sum()
    count = int(mask.sum())
    return total / max(count, 1), total, count


def _logits(seed: int, shape=(3, 5, 11)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(shape[:2], generator=g) > 0.4
    return s, t, mask


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temp", [1.0, 0.7, 2.0])
def test_forward_and_gradients_match_float64_reference(beta: float, temp: float) -> None:
    s, t, mask = _logits(int(beta * 10 + temp * 100))
    s1, t1 = s.clone().requires_grad_(), t.clone().requires_grad_()
    out = generalized_jsd_loss(s1, t1, mask, beta=beta, temperature=temp)
    assert isinstance(out, JSDLossOutput)
    s2, t2 = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss, total, count = _reference(s2, t2, mask, beta, temp, None, None)
    assert int(out.valid_token_count) == count and out.valid_token_count.dtype == torch.long
    torch.testing.assert_close(out.loss, loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-10, atol=1e-12)
    assert float(out.loss.detach()) > 0
    out.loss.backward()
    loss.backward()
    torch.testing.assert_close(s1.grad, s2.grad, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(t1.grad, t2.grad, rtol=1e-8, atol=1e-12)
    assert float(s1.grad[~mask].abs().max()) == 0.0  # masked tokens contribute nothing


def test_float32_inputs_close_to_float64_reference() -> None:
    s, t, mask = _logits(7)
    out = generalized_jsd_loss(s.float(), t.float(), mask, beta=0.5, temperature=1.3)
    assert out.loss.dtype == torch.float32
    ref, _, _ = _reference(s, t, mask, 0.5, 1.3, None, None)
    assert abs(float(out.loss) - float(ref)) < 1e-5


def test_endpoints_are_the_two_kls() -> None:
    """beta 0 is KL(teacher || student), beta 1 KL(student || teacher), per torch's kl_div."""
    s, t, _ = _logits(3)
    mask = torch.ones(s.shape[:2], dtype=torch.bool)
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    fwd = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="sum") / mask.sum()
    rev = torch.nn.functional.kl_div(lt, ls, log_target=True, reduction="sum") / mask.sum()
    torch.testing.assert_close(generalized_jsd_loss(s, t, mask, beta=0.0).loss, fwd)
    torch.testing.assert_close(generalized_jsd_loss(s, t, mask, beta=1.0).loss, rev)
    assert float(generalized_jsd_loss(s, s, mask, beta=0.5).loss) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("top_k,clip", [(4, None), (None, 0.01), (3, 0.02), (11, None)])
def test_teacher_top_k_and_pointwise_clip(top_k: Optional[int], clip: Optional[float]) -> None:
    s, t, mask = _logits(11)
    s1 = s.clone().requires_grad_()
    out = generalized_jsd_loss(s1, t, mask, beta=0.4, temperature=0.9, teacher_top_k=top_k, pointwise_clip=clip)
    s2 = s.clone().requires_grad_()
    ref, total, _ = _reference(s2, t, mask, 0.4, 0.9, top_k, clip)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
    out.loss.backward()
    ref.backward()
    torch.testing.assert_close(s1.grad, s2.grad, rtol=1e-8, atol=1e-12)
    full, _, _ = _reference(s, t, mask, 0.4, 0.9, None, None)
    if top_k == 11 and clip is None:
        torch.testing.assert_close(out.loss, full)
    else:
        assert abs(float(out.loss) - float(full)) > 1e-6  # the option changed the value


def test_empty_mask_gives_zero_loss_and_count() -> None:
    s, t, _ = _logits(5)
    out = generalized_jsd_loss(s, t, torch.zeros(s.shape[:2], dtype=torch.bool))
    assert float(out.loss) == 0.0 and int(out.valid_token_count) == 0 and float(out.loss_sum) == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta=1.5), "beta must be in"),
    (dict(beta=-0.1), "beta must be in"),
    (dict(temperature=0.0), "temperature must be positive"),
    (dict(teacher_top_k=0), "teacher_top_k must be positive"),
    (dict(teacher_top_k=12), "teacher_top_k .* must not exceed the vocabulary size"),
    (dict(pointwise_clip=-1.0), "pointwise_clip must be non-negative"),
])
def test_bad_arguments_name_themselves(kwargs: dict, match: str) -> None:
    s, t, mask = _logits(1)
    with pytest.raises(ValueError, match=match):
        generalized_jsd_loss(s, t, mask, **kwargs)


def test_bad_shapes() -> None:
    s, t, mask = _logits(1)
    with pytest.raises(ValueError, match="matching 3-D shapes"):
        generalized_jsd_loss(s, t[:, :-1], mask)
    with pytest.raises(ValueError, match="matching 3-D shapes"):
        generalized_jsd_loss(s[0], t[0], mask[0])
    with pytest.raises(ValueError, match="response_mask shape"):
        generalized_jsd_loss(s, t, mask[:, :-1])


def _rollout() -> RolloutBatch:
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [3, 4, 5, 9, 2, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]])
    return RolloutBatch(input_ids=ids, attention_mask=mask, response_start_idx=torch.tensor([3, 2]))


def test_response_token_batch_targets_and_mask() -> None:
    batch = ResponseTokenBatch.from_rollout(_rollout())
    assert torch.equal(batch.target_ids, _rollout().input_ids[:, 1:])
    # target column j is token j + 1: a response target when j + 1 >= start and that token is attended
    want = torch.tensor([[False, False, True, True, False], [False, True, True, True, False]])
    assert torch.equal(batch.response_mask, want)
    logits = torch.randn(2, 6, 13)
    assert torch.equal(batch.select_causal_logits(logits), logits[:, :-1])
    with pytest.raises(ValueError, match="3-D"):
        batch.select_causal_logits(logits[0])
    with pytest.raises(ValueError, match="must match input_ids"):
        batch.select_causal_logits(logits[:, :-1])
    with pytest.raises(Exception):  # frozen
        batch.target_ids = None


def test_response_token_batch_feeds_the_loss() -> None:
    """The shifted mask picks exactly the response tokens' predictions (reference: an explicit loop)."""
    batch = ResponseTokenBatch.from_rollout(_rollout())
    s, t = torch.randn(2, 6, 13, dtype=torch.float64), torch.randn(2, 6, 13, dtype=torch.float64)
    out = generalized_jsd_loss(batch.select_causal_logits(s), batch.select_causal_logits(t), batch.response_mask,
                               beta=0.0)
    terms = []
    for row, start in enumerate([3, 2]):
        for pos in range(start, 6):
            if _rollout().attention_mask[row, pos]:
                q, p = t[row, pos - 1].softmax(-1), s[row, pos - 1].softmax(-1)
                terms.append(float((q * (q / p).log()).sum()))
    assert int(out.valid_token_count) == len(terms) == 5
    assert float(out.loss) == pytest.approx(sum(terms) / len(terms), rel=1e-10)


def test_response_token_batch_bad_rollouts() -> None:
    r = _rollout()
    with pytest.raises(ValueError, match=r"response_start_idx must be in \[1, sequence_length"):
        ResponseTokenBatch.from_rollout(RolloutBatch(r.input_ids, r.attention_mask, torch.tensor([0, 2])))
    with pytest.raises(ValueError, match=r"response_start_idx must be in \[1, sequence_length"):
        ResponseTokenBatch.from_rollout(RolloutBatch(r.input_ids, r.attention_mask, torch.tensor([7, 2])))
    with pytest.raises(ValueError, match="integer dtype"):
        ResponseTokenBatch.from_rollout(RolloutBatch(r.input_ids, r.attention_mask, torch.tensor([3.0, 2.0])))
    # a full-length start is allowed: no response targets
    empty = ResponseTokenBatch.from_rollout(RolloutBatch(r.input_ids, r.attention_mask, torch.tensor([6, 6])))
    assert not empty.response_mask.any()
