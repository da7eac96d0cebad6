"""AutoSP (`compile: {deepcompile: true, passes: ["autosp"]}` + engine.compile + prepare_autosp_inputs) on 2
real gloo ranks, sequence_parallel_size 2, ZeRO 0, the "eager" backend (AOT autograd with the AutoSP passes, no
code generation: inductor's C++ builds cost tens of seconds on CPU; the graph it would compile is the same).

Reference: the same model in float64, one process, the whole sequence, torch.optim.AdamW with the same
hyper-parameters. Each rank holds half the sequence and attends over all of it through the all-to-alls; the
loss it returns is the whole batch's token mean (aggregated over the group, ignored tokens not counted), and
the engine sums the ranks' gradients. Checked: every step's loss, the weights after the steps (fp32 within
1e-5 norm-wise per tensor), and the first forward's logits, gathered over the ranks, against the unsharded
forward. Sequence lengths 8 then 12 (one dynamic-length graph serves both). Twice: labels aligned with the
logits, and labels shifted inside the model as Hugging Face does (pad, then drop the first): AutoSP shifts them
on the whole sequence and cuts this rank's chunk after the shift, so no label is lost at a chunk boundary."""
from __future__ import annotations

import copy

import numpy as np
import torch

from tests.harness import run_distributed

STEPS = 3
LR = 1e-2


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _body(rank: int, world: int) -> dict:
    return {loss: _run(rank, world, loss) for loss in ("ce", "shifted")}


def _run(rank: int, world: int, loss_kind: str) -> dict:
    import deepspeed_c
    import torch.distributed as dist
    from deepspeed_c.compile import init_sp
    from deepspeed_c.compile.passes.sp_compile import prepare_autosp_inputs
    from tests.distributed.autosp_model import TinySdpaLM, batch

    torch.manual_seed(0)
    model = TinySdpaLM(loss=loss_kind)
    ref = copy.deepcopy(model).double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2,
              "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,  # the reference does not clip
              "compile": {"deepcompile": True, "passes": ["autosp"]},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.compile(backend="eager")
    losses, ref_losses, logits_err = [], [], None
    for step in range(STEPS):
        ids, labels, pos = batch(step, s=8 if step < 2 else 12)
        ref_loss, ref_logits = ref(ids, labels, pos)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
        ids, labels, pos, _ = prepare_autosp_inputs(ids, labels, pos, seq_dim=1)
        loss, logits = engine(ids, labels, pos)
        if step == 0:  # this rank's chunk of the sequence: gathered in rank order it is the whole forward
            parts = [torch.empty_like(logits) for _ in range(world)]
            dist.all_gather(parts, logits.detach().contiguous())
            logits_err = _rel(torch.cat(parts, 1).double().numpy(), ref_logits.detach().numpy())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: _rel(p.detach().double().numpy(), rp.detach().numpy())
               for (n, p), rp in zip(engine.module.named_parameters(), ref.parameters())}
    return {"losses": losses, "ref_losses": ref_losses, "logits_err": logits_err, "weights": weights,
            "graphs": list(init_sp.graphs_transformed)}


def test_autosp_sp2_matches_single_process_full_sequence() -> None:
    for rank, both in enumerate(run_distributed(_body, world_size=2)):
        for kind, res in both.items():
            assert res["graphs"] and all(g == {"attention": 1, "losses": 1} for g in res["graphs"]), \
                (kind, res["graphs"])
            np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=1e-5, err_msg=kind)
            assert res["logits_err"] < 1e-5, (kind, rank, res["logits_err"])
            bad = {n: e for n, e in res["weights"].items() if not e < 1e-5}
            assert not bad, (kind, rank, bad)
