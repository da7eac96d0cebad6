"""GPU smoke of AutoEP at autoep_size 1 (one GPU): HF Mixtral / Qwen3-MoE tiny, fp32 (TF32 off) and bf16 ZeRO-2,
2 steps through deepspeed_c.initialize vs plain PyTorch on the same GPU; prints relative differences."""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.getcwd())
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29577")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
DEV = os.environ.get("DEV", "cuda")
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
from tests.distributed.test_autoep import LR, batches, make_model  # noqa: E402

import deepspeed_c  # noqa: E402



def run(kind, dtype, stage, ours):
    model = make_model(kind).to(DEV, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if ours:
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": 1}}
        if dtype == torch.bfloat16:
            cfg["bf16"] = {"enabled": True}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, _, _ = deepspeed_c.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for step in batches(1):
        b = step[0].to(DEV)
        loss = model(input_ids=b, labels=b).loss
        if ours:
            model.backward(loss); model.step()
        else:
            opt.zero_grad(); loss.backward(); opt.step()
        losses.append(float(loss))
    mod = model.module if ours else model
    n_experts = sum(type(m).__name__ == "AutoEPExperts" for m in mod.modules())
    return losses, {n: p.detach().float().clone() for n, p in mod.named_parameters()}, n_experts


for kind in ("mixtral", "qwen3_moe"):
    for dtype, stage, tol in ((torch.float32, 0, 1e-4), (torch.bfloat16, 2, 3e-2)):
        ref_l, ref_w, _ = run(kind, dtype, stage, False)
        got_l, got_w, nexp = run(kind, dtype, stage, True)
        wrel = max(float((got_w[n] - w).norm() / w.norm().clamp_min(1e-12)) for n, w in ref_w.items())
        lrel = max(abs(a - b) / abs(b) for a, b in zip(got_l, ref_l))
        ok = wrel < tol and lrel < tol and nexp > 0
        print(f"AUTOEP {kind} {str(dtype)[6:]} z{stage}: replaced {nexp} expert blocks, loss rel {lrel:.2e}, "
              f"weights max rel {wrel:.2e} (tol {tol:g}) {'PASS' if ok else 'FAIL'}", flush=True)
