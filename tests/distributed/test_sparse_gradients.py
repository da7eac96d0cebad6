"""sparse_gradients (runtime/sparse_grads.py) on 2 and 4 gloo ranks, stage 0, fp32, gradient accumulation 2:
an nn.Embedding(sparse=True) and an nn.EmbeddingBag(sparse=True) beside a dense head. At each boundary the
embedding weights' gradients are sparse tensors holding every rank's rows (not a dense all-reduce) whose
dense form equals the gradient of the mean loss over both ranks' batches (float64 reference on one
process), and training with SGD equals that single-process training. Without sparse_gradients the same
model trains the same (the dense path); sparse=True modules without the key train the same through the
sparse rows (DeepSpeed exchanges any sparse gradient so; the dense buckets crashed on them); a ZeRO stage
with sparse_gradients is refused naming the key.
`engine.gradient_average = False` assigned after initialize sums the next boundary's gradients over the ranks
(as DeepSpeed, which reads it at every reduction)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed

VOCAB, DIM, MICRO, GAS, STEPS = 40, 6, 3, 2, 3


class Net(torch.nn.Module):
    def __init__(self, sparse: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.tok = torch.nn.Embedding(VOCAB, DIM, sparse=sparse, dtype=dtype)
        self.bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=sparse, dtype=dtype)
        self.head = torch.nn.Linear(2 * DIM, 1, dtype=dtype)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.tok(ids).mean(1), self.bag(ids)], dim=-1)
        return torch.nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    # rank 0 draws from the low half of the table, the others from the whole: different rows and counts
    ids = torch.randint(0, VOCAB // 2 if rank == 0 else VOCAB, (MICRO, 4 + rank), generator=g)
    return ids, torch.randn(MICRO, generator=g)


def body(rank: int, world: int, sparse_gradients: bool, sparse_modules: bool) -> dict[str, Any]:
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "sparse_gradients": sparse_gradients, "steps_per_print": 10**9}
    model = Net(sparse_modules)
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg,
                                        optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    out: dict[str, Any] = {"grad_sparse": [], "first_grads": None}
    for step in range(STEPS):
        for micro in range(GAS):
            loss = engine(*_batch(step, micro, rank))
            engine.backward(loss)
            if micro == GAS - 1:
                out["grad_sparse"].append(bool(engine.module.tok.weight.grad.is_sparse))
                if step == 0:
                    out["first_grads"] = {n: p.grad.to_dense().numpy().copy() for n, p in engine.module.named_parameters()}
            engine.step()
    out["weights"] = {n: p.detach().numpy().copy() for n, p in engine.module.named_parameters()}  # numpy: host
    # engine.gradient_average assigned after initialize (DeepSpeed's test_averaging_sparse_gradients): the
    # next boundary's gradients are summed over the ranks, sparse rows and dense head alike
    engine.gradient_average = False
    for micro in range(GAS):
        engine.backward(engine(*_batch(STEPS, micro, rank)))
        if micro == GAS - 1:
            out["summed_grads"] = {n: p.grad.to_dense().numpy().copy() for n, p in engine.module.named_parameters()}
        engine.step()
    return out


def _summed_reference(world: int, weights: dict) -> dict:
    """float64 gradients at `weights` of the sum over ranks of each rank's mean over its micro-batches."""
    model = Net(False, torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(weights[n]).double())
    for micro in range(GAS):
        for rank in range(world):
            ids, y = _batch(STEPS, micro, rank)
            (model(ids, y.double()) / GAS).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _reference(world: int) -> tuple[dict, dict]:
    """One process, float64: each step's gradient of the mean over ranks and micro-batches, clipped to norm 1,
    SGD lr 0.5."""
    model = Net(False, torch.float64)
    ref32 = Net(False)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref32.parameters()):
            p.copy_(q.double())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(GAS):
            for rank in range(world):
                ids, y = _batch(step, micro, rank)
                (model(ids, y.double()) / (GAS * world)).backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        # the engine's default gradient_clipping 1.0 (DeepSpeed's coefficient), over the sparse rows too
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        coef = min(1.0, 1.0 / (norm.item() + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(a: Any, b: Any, tol: float) -> None:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    assert (a - b).norm() <= tol * max(b.norm().item(), 1e-12), (a - b).norm()


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_rows_equal_the_dense_average(world: int) -> None:
    runs = {"sparse": run_distributed(body, world, args=(True, True), timeout=180)}
    if world == 2:  # the dense path once; sparse=True modules without the key (DeepSpeed: sparse rows anyway)
        runs["dense"] = run_distributed(body, world, args=(False, False), timeout=180)
        runs["no_key"] = run_distributed(body, world, args=(False, True), timeout=180)
    first, final = _reference(world)
    for res in runs["sparse"] + runs.get("no_key", []):
        assert res["grad_sparse"] == [True] * STEPS
        for name, g in first.items():
            _close(res["first_grads"][name], g, 1e-6)
        for name, w in final.items():
            _close(res["weights"][name], w, 1e-6)
        for name, g in _summed_reference(world, res["weights"]).items():
            _close(res["summed_grads"][name], g, 1e-6)
    if "dense" in runs:
        for a, b in zip(runs["sparse"][0]["weights"].values(), runs["dense"][0]["weights"].values()):
            _close(a, b, 1e-6)
        assert runs["dense"][0]["grad_sparse"] == [False] * STEPS


def _refused(rank: int, world: int, extra: dict) -> str:
    import deepspeed_c

    model = Net()
    try:
        deepspeed_c.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, **extra},
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_sparse_gradients_with_zero_is_refused() -> None:
    msg = run_distributed(_refused, 1, args=({"sparse_gradients": True, "zero_optimization": {"stage": 1}},),
                          timeout=120)[0]
    assert "sparse_gradients" in msg and "stage" in msg


@pytest.mark.parametrize("extra,needle", [
    ({"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}, "zero_optimization.stage=1"),
    ({"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}, "zero_optimization.stage=3"),
    ({"bf16": {"enabled": True}}, "bf16 training"), ({"fp16": {"enabled": True}}, "fp16 training"),
    ({"bf16": {"enabled": True}, "sparse_gradients": True}, "bf16 training")])
def test_sparse_modules_where_gradients_are_flattened_are_refused_at_initialize(extra: dict, needle: str) -> None:
    """sparse=True embeddings under ZeRO or 16-bit masters, with or without the key: refused at initialize
    naming the modules (before, torch's 'reshape is not implemented for sparse tensors' in the first backward)."""
    msg = run_distributed(_refused, 2, args=(extra,), timeout=120)[0]
    assert needle in msg and "['tok', 'bag']" in msg and "sparse=False" in msg, msg
