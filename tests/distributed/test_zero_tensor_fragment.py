"""deepspeed_c.utils.safe_get_full_* / safe_set_full_* / safe_*_local_* on ZeRO stages 1 and 2 (2 gloo
ranks) against single-process float64 PyTorch: the full gradient after an accumulation-boundary backward
is the global-batch gradient, the fp32 master is the model parameter, Adam's moments after one step are
(1 - beta1) g and (1 - beta2) g^2; the local pieces of all ranks together are the whole parameter; the
setters write what the getters then read."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

MICRO = 2


def body(rank: int, world: int, stage: int) -> dict[str, Any]:
    import deepspeed_c
    import torch.distributed as dist
    from deepspeed_c import utils

    model = make_model("mlp", seed=7)
    ref = make_model("mlp", seed=7).double()
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
    x, y = make_batches("mlp", 1, MICRO * world, seed=11)[0]
    lo, hi = rank * MICRO, (rank + 1) * MICRO
    dev = engine.device
    engine.backward(loss_fn(engine(x[lo:hi].to(dev)), y[lo:hi].to(dev)))
    loss_fn(ref(x.double()), y.double()).backward()
    out: dict[str, Any] = {"grad_err": [], "master_err": [], "m_err": [], "v_err": [], "local": [], "set_err": []}
    params = list(model.parameters())
    for p, r in zip(params, ref.parameters()):
        g = utils.safe_get_full_grad(p).cpu()
        out["grad_err"].append(float((g.double() - r.grad).norm() / r.grad.norm()))
    # DeepSpeed's vectorized update: g -> f(g, p) for every parameter (doubled, checked, then halved back: exact)
    before = [utils.safe_get_full_grad(p).clone() for p in params]
    utils.safe_update_full_grad_vectorized(params, lambda g, p: g * 2)
    out["update_err"] = [float((utils.safe_get_full_grad(p) - 2 * b).abs().max()) for p, b in zip(params, before)]
    utils.safe_update_full_grad_vectorized(params, lambda g, p: g / 2)
    out["update_err"] += [float((utils.safe_get_full_grad(p) - b).abs().max()) for p, b in zip(params, before)]
    engine.step()
    for p, r in zip(params, ref.parameters()):
        out["master_err"].append(float((utils.safe_get_full_fp32_param(p) - p.detach()).abs().max().cpu()))
        m = utils.safe_get_full_optimizer_state(p, "exp_avg").double().cpu()
        v = utils.safe_get_full_optimizer_state(p, "exp_avg_sq").double().cpu()
        out["m_err"].append(float((m - 0.1 * r.grad).norm() / (0.1 * r.grad).norm()))
        out["v_err"].append(float((v - 0.001 * r.grad**2).norm() / (0.001 * r.grad**2).norm()))
        local = utils.safe_get_local_fp32_param(p)
        pieces: list[Any] = [None] * world
        dist.all_gather_object(pieces, local.cpu().numpy())
        whole = np.sort(np.concatenate(pieces))
        out["local"].append(bool(np.array_equal(whole, np.sort(p.detach().reshape(-1).cpu().numpy()))))
    # setters: full, then local, read back through the full getters
    p = params[2]
    target = (torch.arange(p.numel(), dtype=torch.float32).view(p.shape) / 7.0).to(dev)
    utils.safe_set_full_fp32_param(p, target)
    got = utils.safe_get_full_fp32_param(p)
    engine.optimizer.refresh_model_params()
    out["set_err"].append(float((got - target).abs().max()))
    out["set_err"].append(float((p.detach() - target).abs().max()))
    local_m = utils.safe_get_local_optimizer_state(p, "exp_avg")
    utils.safe_set_local_optimizer_state(p, torch.full_like(local_m, 3.0), "exp_avg")
    out["set_err"].append(float((utils.safe_get_full_optimizer_state(p, "exp_avg") - 3.0).abs().max()))
    utils.safe_set_full_optimizer_state(p, target, "exp_avg_sq")
    out["set_err"].append(float((utils.safe_get_full_optimizer_state(p, "exp_avg_sq") - target).abs().max()))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_safe_accessors_match_reference(stage: int) -> None:
    for res in run_distributed(body, 2, args=(stage,), timeout=300):
        assert max(res["grad_err"]) < 1e-5
        assert max(res["master_err"]) == 0.0
        assert max(res["m_err"]) < 1e-5
        assert max(res["v_err"]) < 1e-4
        assert all(res["local"])
        assert max(res["set_err"]) == 0.0
        assert max(res["update_err"]) == 0.0


def test_unpartitioned_param_has_no_state() -> None:
    from deepspeed_c import utils

    p = torch.nn.Parameter(torch.ones(3))
    assert utils.safe_get_full_fp32_param(p) is None
    assert utils.safe_get_local_grad(p) is None
    with pytest.raises(ValueError, match="not partitioned"):
        utils.safe_set_full_fp32_param(p, torch.zeros(3))


# -- the full getters move only the parameter's elements (issue 22 item 6) ---------------------------
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
               "all_to_all_single", "gather", "scatter", "reduce")


def _numel(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (list, tuple)):
        return sum(_numel(x) for x in obj)
    return 0


class _CountCollectives:
    """Wraps torch.distributed's collectives (deepspeed_c.comm calls them through the module) and
    adds up the elements of every tensor handed to them, inputs and outputs."""

    def __init__(self) -> None:
        self.elements = 0
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "_CountCollectives":
        import torch.distributed as dist

        for name in COLLECTIVES:
            orig = getattr(dist, name)
            self._saved[name] = orig

            def counted(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
                self.calls += 1
                self.elements += _numel(args) + _numel(list(kwargs.values()))
                return _orig(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def cost_body(rank: int, world: int) -> dict[str, Any]:
    """Stages 1 and 2: for every parameter, each full getter (grad after a boundary backward, master and
    moments after a step) against the whole-group gather it replaced, and the elements it handed to
    collectives against the parameter's size."""
    import deepspeed_c
    from deepspeed_c import utils

    out: dict[str, Any] = {"mismatch": [], "cost": [], "model_numel": 0, "walk": {}}
    for stage in (1, 2):
        model = make_model("mlp", seed=7)
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  # small buckets: parameters split across ranks and buckets
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
        engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
        x, y = make_batches("mlp", 1, MICRO * world, seed=11)[0]
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        opt = engine.optimizer
        params = list(model.parameters())
        out["model_numel"] = sum(p.numel() for p in params)

        def reference(p: torch.nn.Parameter, part: torch.Tensor) -> torch.Tensor:
            _, g, i = p._dsc_zero_owner
            return opt.gather_partition(g, part.detach().float())[i].view(p.shape)

        def check(what: str, get: Any, part_of: Any) -> None:
            total = 0
            for p in params:
                with _CountCollectives() as c:
                    got = get(p)
                total += c.elements
                out["cost"].append((stage, what, p.numel(), c.elements, c.calls))
                want = reference(p, part_of(p))
                if not torch.equal(got.cpu(), want.cpu()):
                    out["mismatch"].append((stage, what, tuple(p.shape)))
            out["walk"][f"{stage}:{what}"] = total

        engine.backward(loss_fn(engine(x[lo:hi]), y[lo:hi]))
        check("grad", utils.safe_get_full_grad,
              lambda p: opt.fp32_partitions[p._dsc_zero_owner[1]].grad
              if opt.fp32_partitions[p._dsc_zero_owner[1]].grad is not None
              else opt.reducer.grad_partitions[p._dsc_zero_owner[1]])
        engine.step()
        check("fp32", utils.safe_get_full_fp32_param, lambda p: opt.fp32_partitions[p._dsc_zero_owner[1]])
        for key in ("exp_avg", "exp_avg_sq"):
            check(key, lambda p, k=key: utils.safe_get_full_optimizer_state(p, k),
                  lambda p, k=key: opt.local_optimizer_state(p._dsc_zero_owner[1])[k])
        engine.destroy()
    return out


def cost_and_set_body(rank: int, world: int) -> dict[str, Any]:
    return {"cost": cost_body(rank, world), "set": set_grad_body(rank, world) if world == 2 else None}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One 2-rank run for both tests below (processes are the slow part)."""
    return run_distributed(cost_and_set_body, 2, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_full_getters_move_only_the_parameter(world: int, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue("two_ranks") if world == 2 else run_distributed(cost_and_set_body, 4,
                                                                                  timeout=300)
    for res in (r["cost"] for r in runs):
        assert not res["mismatch"], res["mismatch"]
        for stage, what, numel, elements, calls in res["cost"]:
            # one all-gather of at most numel elements per rank: sent <= numel, received <= world * numel
            assert calls <= 1 and elements <= (world + 1) * numel, (stage, what, numel, elements, calls)
        for key, total in res["walk"].items():  # walking the model: O(model), not O(params x model)
            assert total <= (world + 1) * res["model_numel"], (key, total)


def set_grad_body(rank: int, world: int) -> dict[str, Any]:
    """safe_set_full_grad writes param.grad when the parameter holds one (DeepSpeed: `param.grad.copy_`):
    stage 0 after backward (the step then uses it: SGD lr 1 moves the weight by exactly -value) and
    ZeRO-1 inside gradient accumulation (gradients not reduced yet)."""
    import deepspeed_c
    from deepspeed_c import utils

    out: dict[str, Any] = {}
    for stage, gas in ((0, 1), (1, 2)):
        model = make_model("mlp", seed=7)
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                  "steps_per_print": 10**9, "gradient_clipping": 0.0,
                  "optimizer": {"type": "SGD", "params": {"lr": 1.0}}, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
        x, y = make_batches("mlp", 1, MICRO * world, seed=11)[0]
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        engine.backward(loss_fn(engine(x[lo:hi]), y[lo:hi]))
        p = list(model.parameters())[0]
        assert p.grad is not None
        value = torch.arange(p.numel(), dtype=p.dtype).view(p.shape) / 100.0
        before = p.detach().clone()
        utils.safe_set_full_grad(p, value)
        out[f"{stage}:set"] = float((p.grad - value).abs().max())
        out[f"{stage}:get"] = float((utils.safe_get_full_grad(p) - value).abs().max())
        if stage == 0:
            engine.step()
            out["0:step"] = float((p.detach() - (before - value)).abs().max())
        engine.destroy()
    return out


def test_set_full_grad_writes_param_grad_when_present(two_ranks: list[dict[str, Any]]) -> None:
    for res in (r["set"] for r in two_ranks):
        assert max(res.values()) < 1e-6, res
