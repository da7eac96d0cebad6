"""AutoEP (autoep_size 2, 2 gloo ranks) in the training forms users combine it with: gradient accumulation
(2 micro-batches a step), Hugging Face activation checkpointing (the experts' all-to-alls run again in the
recomputation) and a frozen part (the token embedding), at ZeRO 0 and 2.

Reference: the same tiny Hugging Face Mixtral in one process, the same embedding frozen, each step the mean loss
of all ranks' micro-batches back-propagated once, then torch.optim.SGD. Checked: every micro-batch's loss and,
after the steps, every weight (experts gathered over the expert-parallel group), fp32, norm-wise relative; the
frozen embedding unchanged."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from tests.distributed.test_autoep import MICRO, SEQ, VOCAB, _rel, make_model
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
    import torch.distributed as dist

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
        weights = {}
        for n, p in engine.module.named_parameters():
            w = p.detach().clone()
            if getattr(p, "allreduce", True) is False:
                parts = [torch.empty_like(w) for _ in range(2)]
                dist.all_gather(parts, w.contiguous())
                w = torch.cat(parts)
            weights[n] = w.numpy()
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
