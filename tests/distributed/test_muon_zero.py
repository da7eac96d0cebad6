"""optimizer.type "Muon" (DeepSpeed 0.19.8's MuonWithAuxAdam) at ZeRO stages 0, 1, 2 and 3 on 2 gloo ranks.

Reference, computed here in float64 in one process from DeepSpeed's update rule: the gradient is the mean of
the two ranks' micro-batch gradients; parameters flagged as DeepSpeed's initialize does (ndim >= 2 and no
"embed"/"lm_head" in the name) take the Muon step (momentum, Nesterov blend, the quintic Newton-Schulz
iteration written out below, the sqrt(max(1, rows/cols)) scale, decoupled weight decay), every other trainable
parameter takes the auxiliary Adam step (bias-corrected, eps outside the root, decoupled decay), and the
frozen layer keeps its weights. The engine runs fp32 with small reduce buckets, so ZeRO 1/2/3 cut the
matrices across the two ranks and the step must exchange them whole. After 20 steps every parameter matches
the reference norm-wise to 2e-5 relative (fp32 rounding through 20 Newton-Schulz runs is ~1e-6). Under
DSC_TEST_BACKEND=nccl Newton-Schulz runs in 16 bits on the GPUs, and the bound is 5e-2. The module's engine runs
share one launch per world size (RUNS): each run is a fresh model and engine on the same ranks."""
from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

STEPS, MICRO, WORLD = 20, 4, 2
MAX_WORLD = 3  # each batch holds a micro-batch for up to this many ranks
PARAMS = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "adam_lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8}
TOL = 5e-2 if os.environ.get("DSC_TEST_BACKEND", "gloo") == "nccl" else 2e-5


class MuonNet(torch.nn.Module):
    """Matrices of several shapes (square, wide, tall, a 3-D stack), 1-D gains and biases, an embedding and a
    head (Adam by name), and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.up = torch.nn.Linear(8, 20)
        self.frozen = torch.nn.Linear(20, 20)
        self.frozen.requires_grad_(False)
        self.mix = torch.nn.Parameter(torch.randn(3, 20, 6) * 0.2)  # a batch of 3 matrices
        self.down = torch.nn.Linear(18, 12, bias=False)
        self.norm = torch.nn.LayerNorm(12)
        self.lm_head = torch.nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.embed(tokens).mean(dim=1)))
        h = torch.tanh(self.frozen(h))
        h = torch.einsum("bi,kio->bko", h, self.mix).flatten(1)
        return self.lm_head(self.norm(torch.tanh(self.down(h))))


def _model(dtype: torch.dtype = torch.float32) -> MuonNet:
    torch.manual_seed(3)
    return MuonNet().to(dtype)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 11, (MICRO * MAX_WORLD, 4), generator=g), torch.randn(MICRO * MAX_WORLD, 5, generator=g))
            for _ in range(STEPS)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = next(model.parameters())  # the rank's device (cpu under gloo, cuda:LOCAL_RANK under NCCL)
    return torch.nn.functional.mse_loss(model(x.to(p.device)), y.to(p.device, p.dtype))


def body(rank: int, world: int, stage: int, ns_method: str, gas: int = 1,
         precision: tuple = ()) -> dict[str, Any]:
    """precision: () for fp32, ("bf16",) or ("fp16", static loss scale)."""
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": dict(PARAMS, ns_method=ns_method)},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 0}}
    model = _model()
    if precision:
        cfg[precision[0]] = {"enabled": True, **({"loss_scale": precision[1]} if len(precision) > 1 else {})}
        model = model.to(torch.bfloat16 if precision[0] == "bf16" else torch.float16)
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    muon_group = next(g for g in engine.basic_optimizer.param_groups if g["use_muon"])
    cut = 0  # Muon matrices whose elements the ZeRO partitions spread over every rank
    if stage > 0:
        assert [p.ndim for p in muon_group["params"]] == [1]  # the step sees a flat partition
        k = engine.basic_optimizer.param_groups.index(muon_group)
        rows = engine.optimizer.partition_plans[k].slices("runtime")
        cut = sum(len({r[1] for r in rows if r[0] == i}) == world for i in range(len(engine.optimizer.bit16_groups[k])))
    for x, y in _batches():
        xs, ys = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(_loss(engine, xs, ys))
        engine.step()
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed_c.zero.GatheredParameters([p for _, p in params]):
            out = {n: p.detach().float().clone().cpu().numpy() for n, p in params}
    else:
        out = {n: p.detach().float().clone().cpu().numpy() for n, p in params}
    flags = {n: bool(getattr(p, "use_muon", False)) for n, p in params}
    engine.destroy()
    return {"params": out, "flags": flags, "cut": cut}


# ---- the float64 reference of DeepSpeed 0.19.8's update --------------------------------------------------
def _newton_schulz(g: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.mT if g.shape[-2] > g.shape[-1] else g
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(5):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if g.shape[-2] > g.shape[-1] else x


def reference(gas: int = 1, world: int = WORLD) -> dict[str, torch.Tensor]:
    """gas > 1: each step's gradient is the mean over gas consecutive batches (and the world's ranks)."""
    model = _model(torch.float64)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = {n: p.ndim >= 2 and "embed" not in n and "lm_head" not in n for n, p in named}
    state: dict[str, dict[str, Any]] = {n: {} for n, _ in named}
    lr, beta, wd = PARAMS["lr"], PARAMS["momentum"], PARAMS["weight_decay"]
    alr, (b1, b2), eps = PARAMS["adam_lr"], PARAMS["betas"], PARAMS["eps"]
    batches = _batches()
    for k in range(0, len(batches), gas):
        grads = {n: torch.zeros_like(p) for n, p in named}
        for x, y in batches[k:k + gas]:
            for r in range(world):
                model.zero_grad(set_to_none=True)
                _loss(model, x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO]).backward()
                for n, p in named:
                    grads[n] += p.grad / (world * gas)
        with torch.no_grad():
            for n, p in named:
                g, st = grads[n], state[n]
                if muon[n]:
                    m = st.setdefault("m", torch.zeros_like(p))
                    m.mul_(beta).add_(g, alpha=1 - beta)
                    u = (1 - beta) * g + beta * m
                    o = _newton_schulz(u) * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
                    p.mul_(1 - lr * wd).sub_(lr * o)
                else:
                    t = st["t"] = st.get("t", 0) + 1
                    m1 = st.setdefault("m1", torch.zeros_like(p))
                    m2 = st.setdefault("m2", torch.zeros_like(p))
                    m1.mul_(b1).add_(g, alpha=1 - b1)
                    m2.mul_(b2).add_(g * g, alpha=1 - b2)
                    step = (m1 / (1 - b1 ** t)) / ((m2 / (1 - b2 ** t)).sqrt() + eps)
                    p.mul_(1 - alr * wd).sub_(alr * step)
    return {n: p.detach() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _reference(gas: int = 1, world: int = WORLD) -> dict[str, torch.Tensor]:
    return reference(gas, world)


# Every engine run of the module, by world size: (stage, ns_method, gas, precision) for the config path, or
# ("client", stage) for the user's own optimizer. One launch per world size runs them one after another.
RUNS: dict[int, tuple[tuple, ...]] = {
    WORLD: tuple((stage, "gram", 1, ()) for stage in (0, 1, 2, 3)) + ((2, "standard", 1, ()),)
    + tuple((stage, "gram", 2, ()) for stage in (1, 2, 3))
    + ((0, "gram", 1, ("fp16", 128)), (2, "gram", 1, ("fp16", 128)), (2, "gram", 1, ("fp16", 1024)),
       (3, "gram", 1, ("fp16", 128)), (2, "gram", 1, ("bf16",)), (3, "gram", 1, ("bf16",)))
    + (("client", 2), ("client", 3)),
    3: tuple((stage, "gram", 1, ()) for stage in (1, 2, 3)),
}


def runs_body(rank: int, world: int, runs: tuple[tuple, ...]) -> list[Any]:
    """The runs one after another on the same ranks, each a fresh model and engine (destroyed before the next);
    a run that raises gives its traceback, so only the tests reading that run fail."""
    import traceback

    out: list[Any] = []
    for run in runs:
        try:
            out.append(client_body(rank, world, run[1]) if run[0] == "client" else body(rank, world, *run))
        except Exception:
            out.append(f"rank {rank}, run {run}:\n{traceback.format_exc()}")
    return out


@functools.lru_cache(maxsize=None)
def _launch(world: int) -> dict[tuple, list[Any]]:
    per_rank = run_distributed(runs_body, world, args=(RUNS[world],), timeout=600)
    return {run: [ranks[i] for ranks in per_rank] for i, run in enumerate(RUNS[world])}


def _run(*run: Any, world: int = WORLD) -> list[Any]:
    got = _launch(world)[run]
    for res in got:
        assert not isinstance(res, str), res
    return got


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_matches_reference(stage: int) -> None:
    ref = _reference()
    start = {n: p.detach().double() for n, p in _model(torch.float64).named_parameters()}
    for rank, res in enumerate(_run(stage, "gram", 1, ())):
        assert stage == 0 or res["cut"] >= 2, res["cut"]
        assert res["flags"]["up.weight"] and res["flags"]["mix"] and res["flags"]["down.weight"]
        assert not res["flags"]["embed.weight"] and not res["flags"]["lm_head.weight"]
        assert not res["flags"]["up.bias"] and not res["flags"]["norm.weight"]
        for name, want in ref.items():
            got = torch.from_numpy(res["params"][name]).double()
            err = ((got - want).norm() / want.norm()).item()
            assert err < TOL, f"stage {stage} rank {rank} {name}: relative error {err:.2e}"
            if name.startswith("frozen"):
                assert torch.equal(got, start[name].float().double()), f"{name} moved"
            else:  # the step did move it: the comparison is not of two unchanged tensors
                assert ((got - start[name]).norm() / start[name].norm()).item() > 1e-3, name


def test_muon_standard_method_at_stage_2() -> None:
    ref = _reference()
    for res in _run(2, "standard", 1, ()):
        for name, want in ref.items():
            got = torch.from_numpy(res["params"][name]).double()
            assert ((got - want).norm() / want.norm()).item() < TOL, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_with_gradient_accumulation(stage: int) -> None:
    """gradient_accumulation_steps 2: Muon steps once per boundary on the accumulated mean gradient (DeepSpeed's
    stage 3 orthogonalises at every micro-step's reduction instead; here every stage steps once)."""
    ref = _reference(2)
    for res in _run(stage, "gram", 2, ()):
        for name, want in ref.items():
            got = torch.from_numpy(res["params"][name]).double()
            assert ((got - want).norm() / want.norm()).item() < TOL, name


@pytest.mark.parametrize("stage, precision, tol", [
    (0, ("fp16", 128), 1e-2), (2, ("fp16", 128), 1e-2), (2, ("fp16", 1024), 1e-2), (3, ("fp16", 128), 1e-2),
    (2, ("bf16",), 5e-2), (3, ("bf16",), 5e-2),
])
def test_muon_in_16_bits(stage: int, precision: tuple, tol: float) -> None:
    """16-bit models with fp32 masters follow the fp32 reference within the 16-bit weights' rounding; under
    fp16 the momentum takes the unscaled gradient, so the static loss scale does not change the result
    (DeepSpeed 0.19.8 feeds the scaled gradient into the momentum and unscales the orthogonalised update)."""
    ref = _reference()
    for res in _run(stage, "gram", 1, precision):
        for name, want in ref.items():
            got = torch.from_numpy(res["params"][name]).double()
            assert ((got - want).norm() / want.norm()).item() < tol, name


def client_body(rank: int, world: int, stage: int) -> dict[str, Any]:
    """The user's own MuonWithAuxAdam (groups by DeepSpeed's rule, hyperparameters as PARAMS) passed to
    initialize, with no optimizer section."""
    import deepspeed_c
    from deepspeed_c.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    model = _model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.ndim >= 2 and "embed" not in n and "lm_head" not in n]
    others = [p for n, p in named if not any(p is q for q in matrices)]
    opt = MuonWithAuxAdam([
        dict(params=matrices, use_muon=True, lr=PARAMS["lr"], momentum=PARAMS["momentum"],
             weight_decay=PARAMS["weight_decay"]),
        dict(params=others, use_muon=False, lr=PARAMS["adam_lr"], betas=tuple(PARAMS["betas"]), eps=PARAMS["eps"],
             weight_decay=PARAMS["weight_decay"])])
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200}}
    engine, *_ = deepspeed_c.initialize(model=model, optimizer=opt, config=cfg)
    for x, y in _batches():
        engine.backward(_loss(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed_c.zero.GatheredParameters([p for _, p in params]):
            out = {n: p.detach().clone().cpu().numpy() for n, p in params}
    else:
        out = {n: p.detach().clone().cpu().numpy() for n, p in params}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_client_muon_optimizer(stage: int) -> None:
    ref = _reference()
    for res in _run("client", stage):
        for name, want in ref.items():
            got = torch.from_numpy(res[name]).double()
            assert ((got - want).norm() / want.norm()).item() < TOL, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_on_three_ranks(stage: int) -> None:
    """Three ranks: matrices cut in three, owners spread unevenly, every source/destination pair exchanging."""
    ref = _reference(1, 3)
    for res in _run(stage, "gram", 1, (), world=3):
        assert res["cut"] >= 1
        for name, want in ref.items():
            got = torch.from_numpy(res["params"][name]).double()
            assert ((got - want).norm() / want.norm()).item() < TOL, name
