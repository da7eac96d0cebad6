"""deepspeed_c.zero.TiledLinear against torch.nn.Linear (float64): outputs and gradients of the tiled
layer equal the whole layer's for uneven splits, pre-split inputs, uncombined outputs and the
return-bias variant; and under ZeRO-3 on 2 gloo ranks a TiledLinear trains like a plain Linear in one
process (torch AdamW with gradient clipping 1.0, DeepSpeed's default, fp32)."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.runtime.zero import TiledLinear, TiledLinearReturnBias
from tests.harness import run_distributed

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def _ref(in_f: int, out_f: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_f, out_f, bias=bias).double()


@pytest.mark.parametrize("in_splits,out_splits,bias", [(1, 1, True), (3, 2, True), (4, 5, False), (7, 1, True)])
def test_forward_and_grads_equal_linear(in_splits, out_splits, bias):
    ref = _ref(11, 9, bias)
    tiled = TiledLinear(11, 9, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=ref).double()
    x = torch.randn(4, 3, 11, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_ref = tiled(x), ref(x2)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    # the tiles' weight gradients are the blocks of the whole weight's gradient
    for r in range(out_splits):
        for c in range(in_splits):
            tile = tiled.linears[r][c]
            block = ref.weight.grad[tiled.out_parts[r]:tiled.out_parts[r + 1], tiled.in_parts[c]:tiled.in_parts[c + 1]]
            torch.testing.assert_close(tile.weight.grad, block, rtol=1e-12, atol=1e-12)
            assert (tile.bias is not None) == (bias and c == in_splits - 1)
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in ref.parameters())


def test_pre_split_input_and_uncombined_output():
    ref = _ref(10, 6)
    tiled = TiledLinear(10, 6, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                        init_linear=ref).double()
    x = torch.randn(5, 10, dtype=torch.float64)
    pieces = [x[:, a:b] for a, b in zip(tiled.in_parts[:-1], tiled.in_parts[1:])]
    out = tiled(pieces)
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(torch.cat(out, dim=-1), ref(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="2 input pieces for in_splits=3"):
        tiled(pieces[:2])


class _ReturnsBias(torch.nn.Linear):
    """Megatron-style: the bias is returned, not added."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant():
    ref = _ref(8, 6)
    tiled = TiledLinearReturnBias(8, 6, in_splits=2, out_splits=3, linear_cls=_ReturnsBias, init_linear=ref).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    y, b = tiled(x)
    torch.testing.assert_close(y, x @ ref.weight.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, ref.bias, rtol=0, atol=0)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="in_splits must be an int in \\[1, 4\\], got 5"):
        TiledLinear(4, 3, in_splits=5)
    for splits in (0, 5):  # DeepSpeed's documented exception for a split count out of range
        with pytest.raises(RuntimeError, match="out_splits"):
            TiledLinear(4, 4, out_splits=splits)
    with pytest.raises(ValueError, match="expected a weight of shape \\(3, 4\\)"):
        TiledLinear(4, 3, init_linear=torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match="no bias but the source has one"):
        TiledLinear(4, 3, bias=False, init_linear=torch.nn.Linear(4, 3))


# -- under ZeRO-3 ------------------------------------------------------------------------------------------
STEPS, MICRO = 4, 3


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, 10, generator=g), torch.randn(MICRO, 7, generator=g)


def _zero3_body(rank: int, world: int) -> list[float]:
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    whole = torch.nn.Linear(10, 7)
    with deepspeed_c.zero.Init(config_dict_or_path=cfg):
        model = TiledLinear(10, 7, in_splits=3, out_splits=2, init_linear=whole)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned as built
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    losses = []
    for s in range(STEPS):
        x, y = (t.to(engine.device) for t in _data(s, rank))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def test_trains_under_zero3_like_a_plain_linear():
    world = 2
    got = run_distributed(_zero3_body, world, timeout=240)
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 7)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
    for s in range(STEPS):
        batches = [_data(s, r) for r in range(world)]
        losses = [torch.nn.functional.mse_loss(ref(x), y) for x, y in batches]
        opt.zero_grad()
        (sum(losses) / world).backward()  # data parallel: the ranks' gradients averaged
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        for r in range(world):
            assert abs(got[r][s] - float(losses[r])) <= 1e-5 * abs(float(losses[r])), (s, r, got[r][s], float(losses[r]))
