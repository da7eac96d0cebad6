"""random-LTD's gather/scatter against a per-token loop reference, and a wrapped layer's forward and
gradients against the dense layer run on the same kept tokens (float64, CPU): the kept tokens' outputs and
every gradient (input, the layer's weights) equal the reference; dropped tokens pass through unchanged."""
from __future__ import annotations

import copy

import pytest
import torch

from deepspeed_c.ops.random_ltd import (GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens,
                                        token_gather, token_scatter)
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from deepspeed_c.runtime.data_pipeline.data_routing.helper import remove_random_ltd_state_dict
from deepspeed_c.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

B, S, H, R = 3, 10, 8, 6


def _loop_gather(x, idx, batch_first):
    rows = []
    for b in range(idx.shape[0]):
        rows.append(torch.stack([x[b, int(i)] if batch_first else x[int(i), b] for i in idx[b]]))
    out = torch.stack(rows)  # [batch, reserved, hidden]
    return out if batch_first else out.transpose(0, 1)


def _loop_scatter(x, part, idx, batch_first):
    out = x.clone()
    for b in range(idx.shape[0]):
        for j, i in enumerate(idx[b]):
            if batch_first:
                out[b, int(i)] = part[b, j]
            else:
                out[int(i), b] = part[j, b]
    return out


@pytest.mark.parametrize("batch_first", [True, False])
def test_gather_scatter_equal_the_loop_reference(batch_first):
    torch.manual_seed(0)
    x = torch.randn((B, S, H) if batch_first else (S, B, H), dtype=torch.float64)
    idx, _ = gpt_sample_tokens(R, S, B, layers=1)
    idx = idx[0]
    assert idx.dtype == torch.int32 and idx.shape == (B, R)
    assert all(torch.equal(row, row.sort().values) and len(set(row.tolist())) == R for row in idx)
    part = token_gather(x, idx, batch_first)
    assert torch.equal(part, _loop_gather(x, idx, batch_first))
    new = torch.randn_like(part)
    assert torch.equal(token_scatter(x, new, idx, batch_first), _loop_scatter(x, new, idx, batch_first))


@pytest.mark.parametrize("batch_first", [True, False])
def test_gather_scatter_gradients_equal_the_loop_reference(batch_first):
    torch.manual_seed(1)
    shape = (B, S, H) if batch_first else (S, B, H)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(H, H, dtype=torch.float64, requires_grad=True)
    idx = gpt_sample_tokens(R, S, B)[0][0]
    probe = torch.randn(shape, dtype=torch.float64)
    full, part = GatherTokens.apply(x, idx, batch_first)
    out = ScatterTokens.apply(full * 2.0, torch.tanh(part @ w), idx, batch_first)
    gx, gw = torch.autograd.grad((out * probe).sum() + (full ** 2).sum(), (x, w))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _loop_scatter(x2 * 2.0, torch.tanh(_loop_gather(x2, idx, batch_first) @ w2), idx, batch_first)
    rx, rw = torch.autograd.grad((ref * probe).sum() + (x2 ** 2).sum(), (x2, w2))
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-13)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-13)


class Block(torch.nn.Module):
    """A causal self-attention block plus MLP: tokens interact, so a wrong gather shows."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(H, 2, batch_first=True, dtype=torch.float64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(H, 16, dtype=torch.float64), torch.nn.GELU(),
                                       torch.nn.Linear(16, H, dtype=torch.float64))

    def forward(self, x, attention_mask=None):
        a, _ = self.attn(x, x, x, attn_mask=attention_mask[0, 0] if attention_mask is not None else None)
        return x + self.mlp(x + a)


def _scheduler(current: int, layers: int = 1) -> RandomLTDScheduler:
    s = RandomLTDScheduler({"total_layer_num": 4, "random_ltd_layer_num": layers, "global_batch_size": B,
                            "random_ltd_schedule": {"min_value": current, "max_value": S,
                                                    "schedule_type": "fixed_linear",
                                                    "schedule_config": {"seq_per_step": 1, "require_steps": 100}}})
    return s


def _config(**over):
    c = {"model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim"}
    c.update(over)
    return c


def test_wrapped_layer_equals_the_dense_layer_on_the_kept_tokens_float64():
    torch.manual_seed(2)
    dense = Block()
    wrapped = RandomLayerTokenDrop(copy.deepcopy(dense))
    sched = _scheduler(R)
    wrapped.init_config(_config(), sched, 0)
    causal = torch.triu(torch.full((S, S), float("-inf"), dtype=torch.float64), 1)[None, None]
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(B, S, H, dtype=torch.float64)
    out = wrapped(x, attention_mask=causal)
    idx, _ = sched.get_sample()
    loss = (out * probe).sum()
    grads = torch.autograd.grad(loss, [x] + list(wrapped.random_ltd_layer.parameters()))

    x2 = x.detach().clone().requires_grad_()
    rows = []
    for b in range(B):
        keep = idx[0, b].long()
        kept_out = dense(x2[b:b + 1, keep], attention_mask=causal[:, :, :R, :R])[0]
        row = x2[b].clone()
        row[keep] = kept_out
        rows.append(row)
    ref = torch.stack(rows)
    ref_grads = torch.autograd.grad((ref * probe).sum(), [x2] + list(dense.parameters()))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
    dropped = torch.ones(B, S, dtype=torch.bool)
    dropped[torch.arange(B)[:, None], idx[0].long()] = False
    assert torch.equal(out[dropped], x.detach()[dropped])  # dropped tokens skip the layer


def test_full_length_and_eval_run_the_dense_layer():
    torch.manual_seed(3)
    dense = Block()
    wrapped = RandomLayerTokenDrop(copy.deepcopy(dense))
    wrapped.init_config(_config(model_mask_name=None), _scheduler(S), 0)
    x = torch.randn(B, S, H, dtype=torch.float64)
    torch.testing.assert_close(wrapped(x), dense(x), rtol=0, atol=0)
    wrapped2 = RandomLayerTokenDrop(copy.deepcopy(dense))
    wrapped2.init_config(_config(model_mask_name=None), _scheduler(R), 0)
    wrapped2.eval()
    torch.testing.assert_close(wrapped2(x), dense(x), rtol=0, atol=0)


def test_encoder_masks_are_the_kept_rows_and_columns():
    torch.manual_seed(4)
    mask = torch.randn(B, 1, S, S)
    idx, masks = bert_sample_tokens(R, S, B, layers=2, attn_mask=mask)
    assert len(masks) == 2
    for layer in range(2):
        for b in range(B):
            keep = idx[layer, b].long()
            assert torch.equal(masks[layer][b, 0], mask[b, 0][keep][:, keep])


@pytest.mark.parametrize("reserved", [1, R, S])
def test_draw_equals_torch_multinomial_from_the_same_seed(reserved):
    """The sync-free draw keeps DeepSpeed's positions: torch.multinomial over ones, sorted, per (layer, sample)."""
    torch.manual_seed(11)
    idx, _ = gpt_sample_tokens(reserved, S, B, layers=4)
    torch.manual_seed(11)
    ref = torch.multinomial(torch.ones(4 * B, S), reserved).sort(dim=-1).values.reshape(4, B, reserved)
    assert idx.dtype == torch.int32 and torch.equal(idx, ref.to(torch.int32))
    assert all(len(set(row.tolist())) == reserved for row in idx.reshape(-1, reserved))
    with pytest.raises(ValueError, match="reserved_length"):
        gpt_sample_tokens(S + 1, S, B)


def test_second_layer_reuses_the_first_layers_draw_and_bad_config_names_the_key():
    sched = _scheduler(R, layers=2)
    first, second = RandomLayerTokenDrop(torch.nn.Identity()), RandomLayerTokenDrop(torch.nn.Identity())
    first.init_config(_config(model_mask_name=None), sched, 0)
    second.init_config(_config(model_mask_name=None), sched, 1)
    x = torch.randn(B, S, H)
    first(x)
    idx, _ = sched.get_sample()
    assert idx.shape == (2, B, R)
    second(x)
    assert sched.get_sample()[0] is idx
    with pytest.raises(DeepSpeedConfigError, match="random_ltd.hidden_state_order"):
        RandomLayerTokenDrop(torch.nn.Identity()).init_config(_config(hidden_state_order="hbs"), sched, 0)
    with pytest.raises(DeepSpeedConfigError, match="random_ltd.model_type"):
        RandomLayerTokenDrop(torch.nn.Identity()).init_config(_config(model_type="seq2seq"), sched, 0)


def test_remove_random_ltd_state_dict_gives_the_unwrapped_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    plain = model.state_dict()
    model[1] = RandomLayerTokenDrop(model[1])
    assert list(remove_random_ltd_state_dict(model.state_dict())) == list(plain)
