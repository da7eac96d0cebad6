"""ZeRO-2 checkpoints in DeepSpeed's flat layout, resharded: saved on 2 ranks, loaded on 1 and saved
again, loaded on 2 and saved again; every checkpoint consolidates (zero_to_fp32, and the Adam moments
concatenated over ranks) to the same values, and the loaded model weights equal the saved ones."""
from __future__ import annotations

import glob
import os
import re

import torch

from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed


def _engine():
    import deepspeed_c

    torch.manual_seed(2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 100}}
    engine, *_ = deepspeed_c.initialize(model=MLP(), config=cfg)
    return engine


def body(rank: int, world: int, src: str | None, dst: str, module_only: bool = False) -> dict:
    engine = _engine()
    if src is None:
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            x, y = torch.randn(2 * world, 12, generator=g), torch.randn(2 * world, 3, generator=g)
            sl = slice(2 * rank, 2 * rank + 2)
            engine.backward(loss_fn(engine(x[sl].to(engine.device)), y[sl].to(engine.device)))
            engine.step()
    elif module_only:
        engine.load_checkpoint(src, load_module_only=True)
        assert engine.global_steps == 0
    else:
        engine.load_checkpoint(src)
        assert engine.global_steps == 4
    engine.save_checkpoint(dst)
    return {k: v.cpu().numpy().copy() for k, v in engine.module.state_dict().items()}


def consolidated_moments(ckpt: str) -> dict[str, torch.Tensor]:
    tag = open(os.path.join(ckpt, "latest")).read()
    files = sorted(glob.glob(os.path.join(ckpt, tag, "zero_pp_rank_*_optim_states.pt")),
                   key=lambda f: int(re.search(r"rank_(\d+)_", f).group(1)))
    from deepspeed_c.checkpoint import safe_load  # the files hold DeepSpeed's pickled loss scaler and stage

    parts = [safe_load.load(f)["optimizer_state_dict"] for f in files]
    numel = sum(parts[0]["group_numels"][0])
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = torch.cat([p["base_optimizer_state"]["state"][0][key] for p in parts])[:numel]
    return out


def test_reshard_2_to_1_to_2(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    saved = run_distributed(body, 2, args=(None, a), timeout=300)
    on_one = run_distributed(body, 1, args=(a, b), timeout=300)
    on_two = run_distributed(body, 2, args=(b, c), timeout=300)
    for got in (on_one[0], on_two[0], on_two[1]):
        for k, v in saved[0].items():
            assert (got[k] == v).all(), k
    ref = get_fp32_state_dict_from_zero_checkpoint(a)
    assert set(ref) == set(saved[0])
    for k, v in saved[0].items():
        assert torch.equal(ref[k], torch.from_numpy(v)), k
    ref_m = consolidated_moments(a)
    assert ref_m["exp_avg_sq"].abs().sum() > 0
    for other in (b, c):
        sd = get_fp32_state_dict_from_zero_checkpoint(other)
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        m = consolidated_moments(other)
        for key in ref_m:
            assert torch.equal(m[key], ref_m[key]), (other, key)


def test_module_only_load_refreshes_the_partitioned_masters(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = run_distributed(body, 2, args=(None, a), timeout=300)
    run_distributed(body, 2, args=(a, b, True), timeout=300)
    # b's masters were saved right after a module-only load: they must be the loaded weights
    sd = get_fp32_state_dict_from_zero_checkpoint(b)
    for k, v in saved[0].items():
        assert torch.equal(sd[k], torch.from_numpy(v)), k
