"""DeepSpeedCPUAdagrad with sparse gradients (nn.Embedding(sparse=True)), as DeepSpeed's: only the
rows the gradient touches move, by Adagrad's rule; repeated rows in one batch are summed first.
Reference: torch.optim.Adagrad on the same sparse gradients (float64), 5 steps, a frozen row set
that must not move, 1e-6 norm-wise relative (fp32 parameters); a dense parameter beside it."""
from __future__ import annotations

import torch

from deepspeed_c.ops.adagrad import DeepSpeedCPUAdagrad


def test_sparse_embedding_matches_torch_adagrad():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 6, sparse=True)
    lin = torch.nn.Linear(6, 1)
    ref_emb = torch.nn.Embedding(20, 6, sparse=True).double()
    ref_lin = torch.nn.Linear(6, 1).double()
    ref_emb.load_state_dict(emb.state_dict())
    ref_lin.load_state_dict(lin.state_dict())
    ours = DeepSpeedCPUAdagrad(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
    theirs = torch.optim.Adagrad(list(ref_emb.parameters()) + list(ref_lin.parameters()), lr=0.1)
    untouched = emb.weight[15:].detach().clone()
    for _ in range(5):
        ids = torch.randint(0, 15, (8,))  # rows 15..19 never used; repeats likely
        for e, l, opt in ((emb, lin, ours), (ref_emb, ref_lin, theirs)):
            opt.zero_grad()
            l(e(ids)).pow(2).mean().backward()
            opt.step()
    for a, b in ((emb.weight, ref_emb.weight), (lin.weight, ref_lin.weight)):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-6, err
    assert torch.equal(emb.weight[15:].detach(), untouched)
    assert ours.state[emb.weight]["step"].item() == 5.0
