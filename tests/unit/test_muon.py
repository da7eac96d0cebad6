"""The Muon optimizer's pieces in one process: Newton-Schulz (both forms, batched) against a float64 iteration
written here, MuonWithAuxAdam against a float64 step of DeepSpeed 0.19.8's rule, the config's Muon / MuSGD
types and their bad input, and the engine's fallback to Adam for a model without matrices."""
from __future__ import annotations

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed_c.runtime.zero.muon.newton_schulz import (newton_schulz_reference, orthogonalize_many,
                                                         orthogonalize_stack)
from deepspeed_c.runtime.zero.muon.original_muon import muon_update
from deepspeed_c.runtime.zero.muon.partitioned import assign_matrices

pytestmark = pytest.mark.usefixtures("world_of_one")


def _ns64(g: torch.Tensor) -> torch.Tensor:
    """The quintic iteration, float64, one matrix (or a batch) at a time."""
    a, b, c = 3.4445, -4.7750, 2.0315
    g = g.double()
    tall = g.shape[-2] > g.shape[-1]
    x = g.mT if tall else g
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(5):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


SHAPES = [(8, 24), (24, 8), (16, 16), (3, 6, 10), (1, 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_newton_schulz_matches_float64(shape: tuple, method: str) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = _ns64(g)
    assert _rel(orthogonalize_stack(g, ns_method=method), want) < 1e-5  # fp32 on the host
    assert _rel(orthogonalize_stack(g.double(), ns_method=method, dtype=torch.float64), want) < 1e-12
    assert _rel(newton_schulz_reference(g), want) < 1e-14
    # 16-bit, as on a GPU: the same map within bf16 / fp16 rounding
    half = torch.bfloat16 if method == "standard" else torch.float16
    assert _rel(orthogonalize_stack(g, ns_method=method, dtype=half), want) < 5e-2


def test_tiny_update_survives_fp16() -> None:
    """A late-training update of ~1e-7 per entry: fp16 would flush it to subnormals if cast before normalising."""
    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(6)) * 1e-7
    assert _rel(orthogonalize_stack(g, ns_method="gram", dtype=torch.float16), _ns64(g)) < 5e-2


def test_newton_schulz_flattens_singular_values() -> None:
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) @ torch.diag(torch.logspace(-2, 1, 64))
    s = torch.linalg.svdvals(orthogonalize_stack(g, ns_method="gram").double())
    assert s.min() > 0.3 and s.max() < 1.3  # the quintic's band, from singular values spread over 3 decades


@pytest.mark.parametrize("batch_elements", [1 << 28, 500])
def test_batched_equals_one_by_one(batch_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed_c.runtime.zero.muon import newton_schulz

    monkeypatch.setattr(newton_schulz, "BATCH_ELEMENTS", batch_elements)  # 500: runs of one or two matrices
    gen = torch.Generator().manual_seed(2)
    shapes = [(12, 20), (20, 12), (12, 20), (7, 7), (2, 12, 20), (4, 3, 2, 2)]
    ups = [torch.randn(*s, generator=gen) for s in shapes]
    got = orthogonalize_many(ups, shapes, "gram")
    for u, s, o in zip(ups, shapes, got):
        view = (s[0], 12) if len(s) == 4 else s  # a conv weight is one (out, in*kh*kw) matrix
        scale = max(1.0, s[-2] / s[-1]) ** 0.5  # from the last two dims, as DeepSpeed's
        assert o.shape == u.shape
        assert _rel(o, (_ns64(u.reshape(view)) * scale).reshape(s)) < 1e-5


def test_muon_update_function_matches_rule() -> None:
    gen = torch.Generator().manual_seed(3)
    g, m = torch.randn(10, 6, generator=gen), torch.randn(10, 6, generator=gen)
    m0 = m.clone()
    out = muon_update(g.clone(), m, beta=0.9, ns_method="standard")
    m_want = 0.9 * m0 + 0.1 * g
    assert _rel(m, m_want) < 1e-6
    assert _rel(out, _ns64(0.1 * g + 0.9 * m_want) * (10 / 6) ** 0.5) < 1e-5


def test_assignment_balances_and_is_deterministic() -> None:
    shapes = [(64, 64)] * 3 + [(64, 256)] * 2 + [(8, 8)] * 5
    owner = assign_matrices(shapes, 2)
    assert owner == assign_matrices(shapes, 2) and set(owner) == {0, 1}
    assert owner[3] != owner[4]  # the two largest go to different ranks


def _reference_steps(w: torch.Tensor, b: torch.Tensor, grads: list, lr: float, beta: float, wd: float,
                     alr: float, betas: tuple, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = w.double().clone(), b.double().clone()
    m = torch.zeros_like(w)
    m1, m2 = torch.zeros_like(b), torch.zeros_like(b)
    for t, (gw, gb) in enumerate(grads, start=1):
        m = beta * m + (1 - beta) * gw.double()
        w = w * (1 - lr * wd) - lr * _ns64((1 - beta) * gw.double() + beta * m) * max(1, w.shape[0] / w.shape[1]) ** 0.5
        m1 = betas[0] * m1 + (1 - betas[0]) * gb.double()
        m2 = betas[1] * m2 + (1 - betas[1]) * gb.double() ** 2
        b = b * (1 - alr * wd) - alr * (m1 / (1 - betas[0] ** t)) / ((m2 / (1 - betas[1] ** t)).sqrt() + eps)
    return w, b


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_optimizer_matches_float64_rule(method: str) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(14, 9, generator=gen))
    b = torch.nn.Parameter(torch.randn(9, generator=gen))
    w0, b0 = w.detach().clone(), b.detach().clone()
    opt = MuonWithAuxAdam([dict(params=[w], use_muon=True, lr=0.05, momentum=0.9, weight_decay=0.1, ns_method=method),
                           dict(params=[b], use_muon=False, lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)])
    grads = [(torch.randn(14, 9, generator=gen), torch.randn(9, generator=gen)) for _ in range(10)]
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    want_w, want_b = _reference_steps(w0, b0, grads, 0.05, 0.9, 0.1, 0.01, (0.8, 0.9), 1e-8)
    assert _rel(w.detach(), want_w) < 1e-5 and _rel(b.detach(), want_b) < 1e-5


def test_defaults_follow_deepspeed() -> None:
    w, b = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3))
    opt = MuonWithAuxAdam([dict(params=[w], use_muon=True), dict(params=[b], use_muon=False)])
    mg, ag = opt.param_groups
    assert (mg["lr"], mg["momentum"], mg["weight_decay"], mg["ns_method"]) == (0.02, 0.95, 0.0, "gram")
    assert (ag["lr"], tuple(ag["betas"]), ag["eps"], ag["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-10, 0.0)


@pytest.mark.parametrize("groups, match", [
    ([dict(params=[torch.nn.Parameter(torch.ones(3, 3))])], "use_muon"),
    ([dict(params=[torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))], use_muon=True)],
     r"shape \(3,\).*ndim >= 2"),
    ([dict(params=[torch.nn.Parameter(torch.ones(3, 3))], use_muon=True, ns_method="fast")], "ns_method"),
    ([dict(params=[torch.nn.Parameter(torch.ones(3, 3))], use_muon=True, momentum=1.0)], "momentum"),
    ([dict(params=[torch.nn.Parameter(torch.ones(3))], use_muon=False, betas=0.9)], "betas"),
    ([dict(params=[torch.nn.Parameter(torch.ones(3))], use_muon=False, lr=-1.0)], "lr"),
])
def test_optimizer_bad_groups(groups: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MuonWithAuxAdam(groups)


def test_frozen_parameters_in_a_group_stay() -> None:
    w, f = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    b, fb = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4), requires_grad=False)
    opt = MuonWithAuxAdam([dict(params=[w, f], use_muon=True, weight_decay=0.5),
                           dict(params=[b, fb], use_muon=False, weight_decay=0.5)])
    f0, fb0, w0 = f.detach().clone(), fb.detach().clone(), w.detach().clone()
    w.grad, b.grad = torch.ones(4, 4), torch.ones(4)
    opt.step()
    assert torch.equal(f.detach(), f0) and torch.equal(fb.detach(), fb0) and not torch.equal(w.detach(), w0)


def test_use_muon_group_of_vectors_takes_adam() -> None:
    b = torch.nn.Parameter(torch.linspace(-1, 1, 4))
    opt = MuonWithAuxAdam([dict(params=[b], use_muon=True, lr=0.1)])
    (group,) = opt.param_groups
    assert group["use_muon"] is False and group["lr"] == 0.1 and tuple(group["betas"]) == (0.9, 0.95)
    b0, g = b.detach().clone(), torch.tensor([0.5, -2.0, 1e-3, 3.0])
    b.grad = g.clone()
    opt.step()
    assert torch.allclose(b.detach(), b0 - 0.1 * g / (g.abs() + 1e-10), rtol=0, atol=1e-6)


# ---- the config's Muon / MuSGD types ----------------------------------------------------------------------
class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 6)
        self.fc = torch.nn.Linear(6, 4)
        self.lm_head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.fc(self.embed(x).mean(1))))


def _cfg(opt_type: str = "Muon", **params) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": opt_type, "params": params}}


@pytest.mark.parametrize("spelling", ["Muon", "muon", "MUON"])
def test_config_builds_muon_with_deepspeed_groups(spelling: str) -> None:
    model = TwoLayer()
    engine, opt, *_ = deepspeed_c.initialize(model=model, config=_cfg(spelling, lr=0.01, muon_lr=0.05, adam_lr=0.002,
                                                                      momentum=0.8, betas=[0.85, 0.9], eps=1e-9))
    basic = engine.basic_optimizer
    assert type(basic).__name__ == "MuonWithAuxAdam"
    assert type(basic).__module__ == "deepspeed_c.runtime.zero.muon.muon_optimizer"
    muon, adam = basic.param_groups
    assert muon["use_muon"] and muon["params"] == [model.fc.weight]
    assert (muon["lr"], muon["momentum"], muon["name"]) == (0.05, 0.8, "muon-params")
    assert {id(p) for p in adam["params"]} == {id(model.embed.weight), id(model.fc.bias), id(model.lm_head.weight),
                                               id(model.lm_head.bias)}
    assert (adam["lr"], tuple(adam["betas"]), adam["eps"]) == (0.002, (0.85, 0.9), 1e-9)
    assert model.fc.weight.use_muon and not model.embed.weight.use_muon and not model.lm_head.weight.use_muon
    before = model.fc.weight.detach().clone()
    engine.backward(engine(torch.randint(0, 7, (2, 3)).to(engine.device)).square().mean())
    engine.step()
    assert not torch.equal(before, model.fc.weight.detach())


def test_model_of_only_vectors_falls_back_to_adam() -> None:
    """No matrix to orthogonalise: DeepSpeed builds only the Adam group; so do we, and it steps as Adam."""
    class Gains(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))
            self.shift = torch.nn.Parameter(torch.zeros(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    model = Gains()
    engine, *_ = deepspeed_c.initialize(model=model, config=_cfg(adam_lr=0.1, betas=[0.9, 0.99], eps=1e-8))
    (group,) = engine.basic_optimizer.param_groups
    assert group["use_muon"] is False and group["lr"] == 0.1
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(5))
    s0, b0 = model.scale.detach().double().clone(), model.shift.detach().double().clone()
    engine.backward((engine(x.to(engine.device)) - 1.0).square().mean())
    engine.step()
    s0, b0 = s0.cpu(), b0.cpu()
    resid = 2 * (x.double() * s0 + b0 - 1.0) / x.numel()  # d mean(r^2) / d output
    gs, gb = (resid * x.double()).sum(0), resid.sum(0)
    for p, p0, g in ((model.scale, s0, gs), (model.shift, b0, gb)):
        step = g / (g.abs() + 1e-8)  # Adam's first bias-corrected step: m = g, v = g^2
        assert _rel(p.detach().cpu(), p0 - 0.1 * step) < 1e-6


@pytest.mark.parametrize("params, match", [
    ({"momentun": 0.9}, "Did you mean 'momentum'"),
    ({"adam_lrr": 0.1}, "Did you mean 'adam_lr'"),
    ({"ns_method": "fast"}, "ns_method"),
    ({"momentum": 1.5}, "momentum"),
    ({"lr": "1e-3"}, r"optimizer.params.lr"),
    ({"betas": [0.9]}, "betas"),
    ({"weight_decay": -0.1}, "weight_decay"),
])
def test_config_refuses_bad_muon_params(params: dict, match: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=match):
        deepspeed_c.initialize(model=TwoLayer(), config=_cfg(**params))


def test_config_type_near_miss_names_muon() -> None:
    with pytest.raises(DeepSpeedConfigError, match="Did you mean 'Muon'"):
        deepspeed_c.initialize(model=TwoLayer(), config=_cfg("Muonn"))


def test_muon_with_optimizer_offload_is_refused() -> None:
    cfg = dict(_cfg(), zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        deepspeed_c.initialize(model=TwoLayer(), config=cfg)


def test_musgd_is_mups() -> None:
    cfg = _cfg("MuSGD", lr=0.1)
    try:
        import mup  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install mup"):
            deepspeed_c.initialize(model=TwoLayer(), config=cfg)
        return
    engine, *_ = deepspeed_c.initialize(model=TwoLayer(), config=cfg)
    assert type(engine.basic_optimizer).__name__ == "MuSGD"


def test_readme_muon_config_builds_and_steps() -> None:
    """The README's Muon section's config, as written, initialises and trains (ZeRO 2, world of one)."""
    import json
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Muon\n", 1)[1]
    cfg = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    model = TwoLayer()
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    assert [g["lr"] for g in engine.basic_optimizer.param_groups] == [0.02, 3e-4]
    before = model.fc.weight.detach().clone()
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 7, (8, 3)).to(engine.device)).square().mean())
        engine.step()
    assert not torch.equal(before, model.fc.weight.detach())
