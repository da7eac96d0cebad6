"""Eigenvalue's power iteration against the dense Hessian (float64): each block's dominant eigenvalue equals
the largest-magnitude eigenvalue of that block's Hessian, the post-processed map is DeepSpeed's ([0, 1] by the
largest magnitude, every parameter of a block keyed by id), the torch generator is left where it was, and a
bad layer_name names the key."""
from __future__ import annotations

import pytest
import torch

from deepspeed_c.runtime.eigenvalue import Eigenvalue


class Net(torch.nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Module()
        self.body.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.body.blocks:
            x = b(x)
        return (x ** 2).sum()


def _dense_top_eigenvalue(model: Net, x: torch.Tensor, block: int) -> float:
    params = list(model.body.blocks[block].parameters())
    shapes = [p.shape for p in params]
    flat0 = torch.cat([p.detach().reshape(-1) for p in params])

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        chunks, at = [], 0
        for s in shapes:
            n = int(torch.tensor(s).prod())
            chunks.append(flat[at:at + n].reshape(s))
            at += n
        names = [n for n, _ in model.body.blocks[block].named_parameters()]
        out = torch.func.functional_call(model.body.blocks[block], dict(zip(names, chunks)), (h_in, ))
        h = out
        for b in model.body.blocks[block + 1:]:
            h = b(h)
        return (h ** 2).sum()

    with torch.no_grad():
        h_in = x
        for b in model.body.blocks[:block]:
            h_in = b(h_in)
    hess = torch.autograd.functional.hessian(loss_of, flat0)
    ev = torch.linalg.eigvalsh(hess)
    return float(ev[ev.abs().argmax()])


def test_power_iteration_equals_the_dense_hessian_float64():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        model = Net()
        x = torch.randn(5, 4)
        loss = model(x)
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        before = torch.random.get_rng_state()
        eig = Eigenvalue(max_iter=5000, tol=1e-12, layer_name="body.blocks", layer_num=3)
        raw = [eig._block(model.body.blocks[b], None, 1.0) for b in range(3)]
        assert torch.equal(torch.random.get_rng_state(), before)
        dense = [_dense_top_eigenvalue(model, x, b) for b in range(3)]
        for got, ref in zip(raw, dense):
            assert abs(abs(got) - abs(ref)) <= 1e-6 * abs(ref), (raw, dense)
        result = eig.compute_eigenvalue(model)
        top = max(abs(v) for v in dense)
        for b, block in enumerate(model.body.blocks):
            for p in block.parameters():
                value, idx = result[id(p)]
                assert idx == b and value == pytest.approx(abs(dense[b]) / top, rel=1e-6)
    finally:
        torch.set_default_dtype(torch.float32)


def test_no_graph_and_bad_layer_name():
    model = Net()
    model(torch.randn(2, 4, dtype=torch.float64)).backward()  # gradients without a graph
    assert Eigenvalue(layer_name="body.blocks", layer_num=3).compute_eigenvalue(model) == {}
    with pytest.raises(ValueError, match="eigenvalue.layer_name"):
        Eigenvalue(layer_name="body.layers", layer_num=3).compute_eigenvalue(model)
    with pytest.raises(ValueError, match="eigenvalue.layer_num"):
        Eigenvalue(layer_name="body.blocks", layer_num=0)
