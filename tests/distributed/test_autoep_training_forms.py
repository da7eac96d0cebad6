"""AutoEP (autoep_size 2, 2 gloo ranks) in the training forms users combine it with: gradient accumulation
(2 micro-batches a step), Hugging Face activation checkpointing (the experts' all-to-alls run again in the
recomputation) and a frozen part (the token embedding), at ZeRO 0 and 2.

Reference: the same tiny Hugging Face Mixtral in one process, the same embedding frozen, each step the mean loss
of all ranks' micro-batches back-propagated once, then torch.optim.SGD. Checked: every micro-batch's loss and,
after the steps, every weight (experts gathered over the expert-parallel group), fp32, norm-wise relative; the
frozen embedding unchanged.

And the ways users call autograd through it: a gradient penalty (create_graph through the experts' exchange:
its backward must be differentiable; 33% off in the attention weights before) against the unsplit model, and
torch.func.grad against torch.autograd.grad on each rank (the exchange needs setup_context), leaving .grad alone."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from tests.distributed.test_autoep import MICRO, SEQ, VOCAB, _rel, gathered_weights, make_model
from tests.harness import run_distributed

STEPS, GAS, LR, TOL = 2, 2, 0.5, 1e-5
FROZEN = "model.embed_tokens.weight"


def _data(world: int) -> list[list[torch.Tensor]]:
    """STEPS lists of world * GAS micro-batches; rank r takes [r * GAS, (r + 1) * GAS) of each."""
    g = torch.Generator().manual_seed(11)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(world * GAS)] for _ in range(STEPS)]


def _model() -> torch.nn.Module:
    model = make_model("mixtral")
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def reference(world: int) -> dict[str, Any]:
    model = _model()
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in _data(world):
        opt.zero_grad()
        per = [model(input_ids=b, labels=b).loss for b in step]
        sum(per).div(len(per)).backward()
        opt.step()
        losses.append([float(x.detach()) for x in per])
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _rank_body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c

    out = {}
    for stage in (0, 2):
        model = _model()
        model.gradient_checkpointing_enable()
        model.train()
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0,
               "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
               "expert_parallel": {"enabled": True, "autoep_size": 2}}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = deepspeed_c.initialize(model=model, optimizer=opt, config=cfg)
        losses = []
        for step in _data(world):
            for b in step[rank * GAS:(rank + 1) * GAS]:
                loss = engine(input_ids=b, labels=b).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        weights = {n: w.numpy() for n, w in gathered_weights(engine.module, 2).items()}
        out[f"z{stage}"] = {"losses": losses, "weights": weights, "steps": engine.global_steps}
    return out


def test_autoep_with_accumulation_checkpointing_and_frozen_embedding() -> None:
    results = run_distributed(_rank_body, 2, timeout=300)
    ref = reference(2)
    init = {n: p.detach() for n, p in _model().named_parameters()}
    for tag in ("z0", "z2"):
        for rank, res in enumerate(results):
            r = res[tag]
            assert r["steps"] == STEPS, f"{tag} rank {rank}: {r['steps']} optimizer steps"
            want = [loss for step in ref["losses"] for loss in step[rank * GAS:(rank + 1) * GAS]]
            assert len(r["losses"]) == len(want)
            for i, (got, exp) in enumerate(zip(r["losses"], want)):
                assert abs(got - exp) <= TOL * abs(exp), f"{tag} rank {rank} micro-batch {i}: {got} vs {exp}"
            assert set(r["weights"]) == set(ref["weights"])
            for n, w in ref["weights"].items():
                got = torch.from_numpy(r["weights"][n])
                if n == FROZEN:
                    assert torch.equal(got, init[n]), f"{tag} rank {rank}: the frozen embedding changed"
                    continue
                assert _rel(init[n], w) > 2e-4, f"{n}: the reference barely moved it"
                assert _rel(got, w) < TOL, f"{tag} rank {rank} {n}: relative difference {_rel(got, w):.3g}"


PENALTY = 10.0


def _penalised(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The task loss plus a gradient penalty on the input embeddings (create_graph: the penalty's own gradient
    runs through the backward of the experts' exchange)."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=emb, labels=ids).loss
    (g,) = torch.autograd.grad(loss, emb, create_graph=True)
    return loss + PENALTY * g.pow(2).sum()


def _eager_model() -> torch.nn.Module:
    model = make_model("mixtral")
    model.set_attn_implementation("eager")  # torch's CPU flash attention has no double backward
    return model


def penalty_reference(world: int) -> dict[str, torch.Tensor]:
    model = _eager_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = _data(world)[0][:world]
    opt.zero_grad()
    sum(_penalised(model, b) for b in step).div(world).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _penalty_body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c

    model = _eager_model()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0, "zero_optimization": {"stage": 0},
           "expert_parallel": {"enabled": True, "autoep_size": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = deepspeed_c.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                                 config=cfg)
    total = _penalised(engine.module, _data(world)[0][rank])
    engine.backward(total)
    engine.step()
    return {n: w.numpy() for n, w in gathered_weights(engine.module, 2).items()}


def test_autoep_gradient_penalty_through_the_exchange() -> None:
    """create_graph: the experts' exchange backward is itself differentiable (an exchange with swapped splits)."""
    results = run_distributed(_penalty_body, 2, timeout=300)
    ref = penalty_reference(2)
    init = {n: p.detach() for n, p in make_model("mixtral").named_parameters()}
    for rank, weights in enumerate(results):
        for n, w in ref.items():
            got = torch.from_numpy(weights[n])
            assert _rel(got, w) < TOL, f"rank {rank} {n}: relative difference {_rel(got, w):.3g} (moved " \
                                       f"{_rel(init[n], w):.3g})"


def _func_grad_body(rank: int, world: int) -> dict[str, Any]:
    """torch.func.grad through the AutoEP model on each rank, against torch.autograd.grad of the same loss."""
    import deepspeed_c

    model = make_model("mixtral")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = deepspeed_c.initialize(model=model, config=cfg)
    module, ids = engine.module, _data(world)[0][rank]
    params = {n: p.detach() for n, p in module.named_parameters()}

    def loss_of(ps: dict) -> torch.Tensor:
        return torch.func.functional_call(module, ps, (ids,), {"labels": ids}).loss

    got = torch.func.grad(loss_of)(params)
    names = list(params)
    want = torch.autograd.grad(module(input_ids=ids, labels=ids).loss, [dict(module.named_parameters())[n]
                                                                       for n in names])
    held = [n for n, p in module.named_parameters() if p.grad is not None]
    return {"rel": {n: _rel(got[n], w) for n, w in zip(names, want)}, "held": held}


def test_autoep_torch_func_grad_equals_autograd() -> None:
    for rank, res in enumerate(run_distributed(_func_grad_body, 2, timeout=300)):
        bad = {n: r for n, r in res["rel"].items() if not r < TOL}
        assert not bad, f"rank {rank}: torch.func.grad differs from autograd.grad: {bad}"
        assert res["held"] == [], f"rank {rank}: .grad written by a gradient taken for other ends: {res['held']}"
